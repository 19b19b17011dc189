"""A flag's default is written once, in its config dataclass: the steer and probes parsers take theirs from it
(``common.config_defaults``), so the command line and a Python caller cannot drift apart."""

from __future__ import annotations

import dataclasses

from mechprobe.cli import common
from mechprobe.cli import linear_probe as cli_probes
from mechprobe.cli import steer as cli_steer
from mechprobe.linear.experiment import LinearProbeConfig
from mechprobe.steering.config import SteerConfig


def _same_defaults(a, cfg) -> None:
    for f in dataclasses.fields(type(cfg)):
        if hasattr(a, f.name):
            assert getattr(a, f.name) == getattr(cfg, f.name), f.name


def test_every_steer_flag_default_is_the_configs():
    _same_defaults(cli_steer.build_parser().parse_args([]), SteerConfig())


def test_every_probes_flag_default_is_the_configs():
    _same_defaults(common.command_parser(cli_probes.add_args, cli_probes.__doc__).parse_args([]), LinearProbeConfig())
