"""One alpha, one unit: the same alpha adds the same norm through ``steer``, ``SteeringVector.apply`` and the
``steer`` command's path (its config, the registered vector kinds and the experiment's steered forwards).

Oracle: the added vector read back from ``output_hidden_states`` at the boundary position is ``alpha x
resid_norm`` long on every path (the package's unit), and ``unit="raw"`` (CAA) adds ``alpha x |v|`` instead.
"""

from __future__ import annotations

import pytest
import torch

from mechprobe.cli import steer as cli_steer
from mechprobe.errors import UsageError
from mechprobe.lm.forward import tiny_model
from mechprobe.lm.generation import left_pad
from mechprobe.steering.config import SteerConfig
from mechprobe.steering.evaluate import steered
from mechprobe.steering.experiment import kind_vectors
from mechprobe.steering.vector import SteeringVector, VectorContext, bake, diff_of_means, steer

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]
LAYER = 2
ALPHA = 0.2


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", initializer_range=0.2)


def _hidden(model, layer=LAYER):
    ids, mask, pos = left_pad(PROMPTS, 0, torch.device("cpu"))
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True).hidden_states[layer]


def _added(model, ctx) -> torch.Tensor:
    """Norm of what the context manager adds at the boundary (last position) of each prompt."""
    base = _hidden(model)
    with ctx:
        moved = _hidden(model)
    return (moved - base)[:, -1].norm(dim=-1)


def _raw_vector(model):
    """A raw difference of means of real boundary states (genuine = the first prompt), with its resid_norm."""
    h = _hidden(model)[:, -1]
    g = torch.Generator().manual_seed(0)
    pos, neg = h[:1] + torch.randn(3, h.shape[1], generator=g), h[1:] + torch.randn(4, h.shape[1], generator=g)
    return diff_of_means(pos, neg, LAYER)


class _Cache:
    """The few cache reads the built-in kinds make (the probe kind is not asked for here)."""


def test_the_same_alpha_adds_the_same_norm_through_steer_apply_and_the_cli(model):
    raw = _raw_vector(model)
    want = ALPHA * raw.resid_norm
    assert abs(raw.norm - raw.resid_norm) > 0.1 * raw.resid_norm  # raw and resid units really differ here
    via_steer = _added(model, steer(model, raw, ALPHA, "boundary"))
    via_apply = _added(model, raw.apply(model, alpha=ALPHA, positions="boundary"))
    # The command line: its flags -> SteerConfig -> the registered kinds in the config's unit -> the experiment's
    # steered forwards.
    cfg = cli_steer.config_from_args(cli_steer.build_parser().parse_args(
        ["--alpha", "0", str(ALPHA), "--steer-positions", "boundary", "--kinds", "diff_means,negative,random"]))
    assert cfg.alphas == [0.0, ALPHA] and cfg.alpha_unit == "resid"
    mask = torch.ones(7, dtype=torch.bool)
    ctx = VectorContext(cache=_Cache(), layer=LAYER, train_rows=mask, pos_rows=mask, neg_rows=~mask, reference=raw)
    vectors = kind_vectors(cfg, ctx)
    assert [v.kind for v in vectors] == ["diff_means", "random", "negative"]
    for got in (via_steer, via_apply, *(_added(model, steered(model, v, ALPHA, cfg.positions)) for v in vectors)):
        # float32: h + d - h loses ~1e-7 x |h| per entry
        torch.testing.assert_close(got, torch.full_like(got, want), rtol=1e-4, atol=1e-5)
    # The explicit CAA option adds alpha x |v| on every entry point.
    for ctx_raw in (steer(model, raw, ALPHA, "boundary", unit="raw"),
                    raw.apply(model, alpha=ALPHA, positions="boundary", unit="raw")):
        got = _added(model, ctx_raw)
        torch.testing.assert_close(got, torch.full_like(got, ALPHA * raw.norm), rtol=1e-4, atol=1e-5)


def test_one_resid_alpha_is_the_same_ladder_from_python_and_the_command_line():
    from_cli = cli_steer.config_from_args(cli_steer.build_parser().parse_args(["--alpha", "4"]))
    assert from_cli.alpha == [4.0]  # what was asked for is kept; the ladder is the config's
    assert from_cli.alphas == SteerConfig(alpha=[4]).alphas == [0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 4]
    assert SteerConfig(alpha=[4], alpha_unit="raw").alphas == [4.0]
    assert SteerConfig().alphas == [0.0, 0.05, 0.1, 0.2, 0.4, 0.8]


def test_bake_adds_what_steer_adds_in_either_unit():
    model = tiny_model("llama", seed=0)
    raw = _raw_vector(model)
    ids = torch.tensor([PROMPTS[0]])
    for unit in ("resid", "raw"):
        with torch.no_grad(), steer(model, raw, ALPHA, "all", unit=unit):
            want = model(ids).logits
        baked = bake(tiny_model("llama", seed=0), raw, ALPHA, unit=unit)
        with torch.no_grad():
            torch.testing.assert_close(baked(ids).logits, want, rtol=1e-4, atol=1e-5)
        assert baked.config.mechprobe_steering["alpha_unit"] == unit


def test_a_vector_without_its_yardstick_is_refused_with_the_raw_option_named(model):
    bare = SteeringVector(torch.ones(64), LAYER)
    with pytest.raises(UsageError, match="unit='raw'"):
        steer(model, bare, ALPHA).__enter__()
    with steer(model, bare, ALPHA, unit="raw"):
        pass



def test_the_config_a_caller_passes_is_never_changed():
    """Run-time choices go into a resolved copy (dataclasses.replace): SteerConfig is frozen."""
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        SteerConfig().judge = "offline"  # type: ignore[misc]
    cfg = SteerConfig(alpha=[4])
    assert dataclasses.replace(cfg, judge="offline").alpha == [4] and cfg.judge == "auto"
