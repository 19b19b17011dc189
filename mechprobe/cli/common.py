"""Flags, help formatting, error handling and the run-directory argument shared by every command.

Every command module of this package has the same two entry points: ``add_args(parser)`` adds its flags to a
parser (the ``mechprobe`` subcommand's, or a parser of its own for ``experiments/<script>.py``) and
``run(args) -> int`` runs it. Each shared flag is defined once, here.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import re
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mechprobe.errors import UsageError, UserError
from mechprobe.judges.factory import judge_help
from mechprobe.judges.registry import BEST_JUDGE

EXIT_CODES = """exit codes:
  0  ok
  2  a usage or input mistake you can fix: one line on stderr naming the problem and the fix
  3  the run is too small for the analysis: the outputs written so far are kept
  1  an unexpected error: the traceback is a bug worth reporting"""

# Any decimal or scientific number (-1, -.5, -1e308, -2.5E-3): argparse before Python 3.12 takes only -1 and -0.5
# for numbers, so `--alpha 0 -1e308` read -1e308 as an unknown flag.
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

# Sphinx roles (:class:`~a.B`, :func:`f`) and reST literals (``x``): module docstrings double as help texts, and a
# terminal shows the markup verbatim.
_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]*)``")


def plain(text: str | None) -> str:
    """``text`` without Sphinx roles and reST literal markup, for a terminal (``:class:`~x.Y``` -> ``x.Y``)."""
    text = _ROLE.sub(lambda m: m.group(1), text or "")
    return _LITERAL.sub(lambda m: m.group(1), text)


def _show(value: Any) -> str:
    """A default as the user would type it (lists space-separated), with ``%`` escaped for argparse."""
    if isinstance(value, list | tuple):
        value = " ".join(str(v) for v in value)
    return str(value).replace("%", "%%")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's own line breaks (its examples) and appends each option's default to its help.

    A default is shown unless it is None or False (an unset option or a switch: its help says what happens then)
    or the help already names it ("(default ...", "default: ...").
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        d = action.default
        if d is None or d is False or d is argparse.SUPPRESS or d == [] or re.search(r"\(default\b|default:", text):
            return text
        return f"{text} (default: {_show(d)})".strip()


def package_version() -> str:
    """The installed distribution's version, else the one in the clone's pyproject.toml (an uninstalled clone)."""
    try:
        return importlib.metadata.version("mechprobe")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        if pyproject.is_file():
            return str(tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["version"])
        return "unknown"


def accept_negative_numbers(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Let numeric list flags take negative numbers in any notation; also for ``p``'s subcommands."""
    p._negative_number_matcher = _NEGATIVE_NUMBER  # argparse has no public hook for this
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in action.choices.values():
                accept_negative_numbers(sp)
    return p


def command_parser(add_args: Callable[[argparse.ArgumentParser], None], doc: str | None,
                   prog: str | None = None) -> argparse.ArgumentParser:
    """A parser of one command's flags alone (``python experiments/<script>.py``); ``doc`` is its description."""
    p = argparse.ArgumentParser(prog=prog, description=plain(doc), formatter_class=HelpFormatter, epilog=EXIT_CODES)
    add_args(p)
    return accept_negative_numbers(p)


# A config field named in a message below cli/ (``alpha=4``, ``max_heldout=``): the package names settings by their
# config field, the command line by its flag.
_FIELD = re.compile(r"(?<![\w.\-])([a-z][a-z0-9_]*)=")
_SWITCH = re.compile(r"(?<![\w.\-])[a-z][a-z0-9_]*=(?:True|False)\b")


def flag_names(p: argparse.ArgumentParser) -> dict[str, str]:
    """Config field (argparse ``dest``) -> the flag that sets it (its first long option), for ``p``'s options;
    switches also as ``field=True`` (and ``field=False`` for a ``--no-`` switch) -> the flag alone."""
    out: dict[str, str] = {}
    for action in p._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs:
            continue
        out.setdefault(action.dest, longs[0])
        if isinstance(action, argparse._StoreTrueAction):
            out.setdefault(f"{action.dest}=True", longs[0])
        elif isinstance(action, argparse.BooleanOptionalAction):
            out.setdefault(f"{action.dest}=True", longs[0])
            out.setdefault(f"{action.dest}=False", next((o for o in longs if o.startswith("--no-")), longs[0]))
    # A command whose advice names another command's settings (steer suggests re-running `mechprobe probes` with
    # limit=...) lists that command's parsers here; its own flags win where both have the field.
    for other in getattr(p, "advice_parsers", ()):
        for k, v in flag_names(other).items():
            out.setdefault(k, v)
    return out


def as_flags(message: str, flags: dict[str, str]) -> str:
    """``message`` with every ``field=`` of a known field written as its flag (``alpha=4`` -> ``--alpha 4``,
    ``new=True`` -> ``--new``).

    Why: errors below :mod:`mechprobe.cli` name the config field a Python caller set; a command-line user set a
    flag, and should be told that flag. Other ``name=`` text (a field this command has no flag for) is kept.

    Example:
        >>> as_flags("alpha=-1: must be > 0; or alpha_unit='raw', new=True",
        ...          {"alpha": "--alpha", "alpha_unit": "--alpha-unit", "new=True": "--new"})
        "--alpha -1: must be > 0; or --alpha-unit 'raw', --new"
    """
    message = _SWITCH.sub(lambda m: flags.get(m.group(0), m.group(0)), message)

    def sub(m: re.Match[str]) -> str:
        flag = flags.get(m.group(1))
        if flag is None:
            return m.group(0)
        nxt = message[m.end():m.end() + 1]
        return flag + (" " if nxt and not nxt.isspace() and nxt not in ",;:)" else "")
    return _FIELD.sub(sub, message)


def friendly(fn: Callable[[], int | None], parser: argparse.ArgumentParser | None = None) -> int:
    """Run ``fn``; a UserError becomes one line on stderr and exit code 2, anything else propagates.

    With ``parser`` (the command's), config fields named in the message are shown as that command's flags
    (:func:`as_flags`)."""
    try:
        return int(fn() or 0)
    except UserError as e:
        msg = as_flags(str(e), flag_names(parser)) if parser is not None else str(e)
        print(f"mechprobe: error: {msg}", file=sys.stderr)
        return 2


def command_of(p: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The subcommand parser ``name`` of ``p`` (``p`` itself when it has none of that name)."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return p


def config_defaults(config: type) -> dict[str, Any]:
    """Every field of the config dataclass ``config`` -> its default, so a flag's default is written once (in the
    config) and the command line cannot drift from a Python caller's."""
    made = config()
    return {f.name: getattr(made, f.name) for f in dataclasses.fields(config)}


def add_run(p: argparse.ArgumentParser, help: str, flag: str | None = None, optional: bool = False) -> None:
    """The run directory: a positional shown as RUN in every command that takes one.

    ``flag`` (``--run``, or ``--out`` for the probe) also accepts it as an option, where that option worked before;
    the two are merged by :func:`merge_run`. ``optional``: without RUN the command builds or picks a default run.
    """
    if flag is None:
        p.add_argument("run", metavar="RUN", nargs="?" if optional else None, help=help)
        return
    p.add_argument("run_pos", nargs="?", default=None, metavar="RUN", help=f"{help} (same as {flag})")
    dest = flag.lstrip("-").replace("-", "_")
    p.add_argument(flag, dest=dest, default=None, metavar="RUN", help="the same as RUN")


def merge_run(a: argparse.Namespace, dest: str = "run") -> None:
    """Positional RUN and ``--run`` name the same thing: accept either, refuse two different ones."""
    pos = getattr(a, "run_pos", None)
    if pos is None:
        return
    given = getattr(a, dest, None)
    if given is not None and Path(given) != Path(pos):
        raise UsageError(f"two run directories given ({pos} and --{dest} {given}): pass one")
    setattr(a, dest, pos)


def batch_size_arg(v: str) -> int | None:
    """``--batch-size`` value: a positive integer, or ``auto`` (None: as many rows as fit in memory)."""
    if v.strip().lower() == "auto":
        return None
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"--batch-size must be a positive integer or 'auto', got {v!r}")
    return n


# ------------------------------------------------------------------ flags shared by several commands, defined once

def best_judge_weights() -> str:
    """The version of the weights the package ships for :data:`BEST_JUDGE` (``hidden-v7``), read from the file the
    judge loads, so ``--help`` names the fit ``auto`` runs and never goes stale when a refit replaces it. The file is
    read as JSON only (no torch import at CLI start-up); a missing or unreadable file gives a phrase, not an error."""
    path = Path(__file__).resolve().parents[1] / "data" / f"hidden_judge_{BEST_JUDGE.split(':', 1)[1]}.json"
    try:
        return str(json.loads(path.read_text(encoding="utf-8"))["version"])
    except (OSError, KeyError, ValueError, TypeError):
        return "its packaged weights"


JUDGE_HELP = (f"{judge_help()} | auto (default). "
              "auto: openai:$MECHPROBE_JUDGE_MODEL when set; else the judge that already labelled the run; else "
              "offline for the embedded default model; else the best-validated judge this machine can run "
              f"({BEST_JUDGE} at weights {best_judge_weights()}, the hidden-state judge, when its reader is fetched, "
              "else offline)")
"""``--judge``'s help: every registered judge kind (:mod:`mechprobe.judges.kinds`), then what ``auto`` means."""
DTYPES = ("float32", "bfloat16", "float16")


def add_judge(p: argparse.ArgumentParser | argparse._ArgumentGroup, required: bool = False) -> None:
    """``--judge``: one meaning everywhere; ``auto`` is resolved by :func:`mechprobe.judges.factory.default_judge`."""
    if required:
        p.add_argument("--judge", required=True, help=JUDGE_HELP.split(" | auto")[0])
    else:
        p.add_argument("--judge", default="auto", help=JUDGE_HELP)


def add_dtype(p: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None = None,
              help: str = "HF weights dtype (default: the run's own; for a new run fp32 on CPU, bf16 on CUDA)") -> None:
    """``--dtype``: the dtype the model's weights are loaded in (never a storage dtype: see ``--store-dtype``)."""
    p.add_argument("--dtype", default=default, choices=list(DTYPES), help=help)


def add_engine(p: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None = None,
               help: str = "generation engine: hf (exact, hookable), llamacpp (GGUF on CPU, docs/cpu_speed.md), "
                           "vllm (GPU)") -> None:
    """``--engine``: which runtime generates turns."""
    p.add_argument("--engine", default=default, choices=["hf", "llamacpp", "vllm"], help=help)


def add_model(p: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None = None,
              help: str = "embedded name, HF id/dir, or .gguf file") -> None:
    """``--model``: an embedded model's name, a Hugging Face id or directory, or a GGUF file."""
    p.add_argument("--model", default=default, help=help)


def add_seed(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--seed``: one seed for sampling, folds and bootstraps, so a rerun gives the same numbers."""
    p.add_argument("--seed", type=int, default=0, help="random seed (sampling, folds, bootstraps)")


def add_device(p: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None = None) -> None:
    """``--device``: where the model runs (torch device string)."""
    p.add_argument("--device", default=default, help="cpu | cuda | cuda:N (default: cuda when available)")


def add_figures(p: argparse.ArgumentParser | argparse._ArgumentGroup, default: str | None = None) -> None:
    """``--figures``: where figures go; inside the run by default, so a run never dirties the repository."""
    p.add_argument("--figures", default=default,
                   help="folder for the figure (default: <run>/figures, inside the ignored run directory, so a run "
                        "never dirties the repo; pass --figures figures to publish into the committed folder)")


def add_data_path(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--data-path``: where the datasets are read from."""
    p.add_argument("--data-path", default=None,
                   help="dataset file or folder laid out like shared/data (default: ../shared/data or $MECHPROBE_DATA_DIR)")


def add_no_progress(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--no-progress``: quiet logs (batch jobs, tests)."""
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_new_run(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--new``: building a run at an explicit RUN must be asked for, so a mistyped path is refused."""
    p.add_argument("--new", action="store_true",
                   help="RUN names a run to build (from nothing): without it a RUN that is not a run yet is refused, so "
                        "a mistyped path does not start a full build; the default run is always built")


def add_include_truncated(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--include-truncated``: keep the user turns that follow a truncated assistant answer in the rates."""
    p.add_argument("--include-truncated", action="store_true",
                   help="keep user turns after an assistant answer that hit its token cap in the follow-up rates "
                        "(default: counted and left out; every table says 'k of n answers truncated, excluded')")
