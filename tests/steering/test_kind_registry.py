"""The vector-kind registry: a new way to build a steering vector is one module with ``@register_vector_kind``;
the experiment (``kind_vectors``), ``SteerConfig.kinds``, the CLI's ``--kinds`` and ``SteeringVector`` read it."""

from __future__ import annotations

import pytest
import torch

from mechprobe.cli import steer as cli_steer
from mechprobe.errors import UsageError
from mechprobe.steering import kind_registry
from mechprobe.steering.config import SteerConfig
from mechprobe.steering.experiment import kind_vectors
from mechprobe.steering.vector import (
    SteeringVector,
    VectorContext,
    check_kinds,
    default_kinds,
    diff_of_means,
    register_vector_kind,
    vector_kinds,
)


def _ctx() -> VectorContext:
    g = torch.Generator().manual_seed(0)
    pos, neg = torch.randn(5, 16, generator=g) + 1, torch.randn(6, 16, generator=g)
    ref = diff_of_means(pos, neg, 2)
    rows = torch.ones(11, dtype=torch.bool)
    return VectorContext(cache=None, layer=2, train_rows=rows, pos_rows=rows, neg_rows=~rows, reference=ref, seed=3)


def test_the_built_in_kinds_keep_their_order_and_defaults():
    assert vector_kinds()[:4] == default_kinds() == ("diff_means", "random", "negative", "probe")
    assert SteerConfig().kinds == "diff_means,random,negative,probe"
    assert cli_steer.build_parser().parse_args([]).kinds == SteerConfig().kinds  # the default is written once
    assert check_kinds("probe,diff_means") == ["diff_means", "probe"]  # table order, whatever the order given
    with pytest.raises(UsageError, match="kinds=bogus"):
        check_kinds("bogus")


def test_a_registered_kind_is_built_by_the_experiment_and_accepted_everywhere(monkeypatch):
    monkeypatch.setattr(kind_registry, "_KINDS", dict(kind_registry._KINDS))

    @register_vector_kind("doubled_test", order=900)
    def doubled(ctx: VectorContext) -> SteeringVector:
        """Twice the difference of means (a test kind)."""
        return SteeringVector(2 * ctx.reference.vector, ctx.layer, "doubled_test", dict(ctx.reference.metadata))

    assert "doubled_test" in vector_kinds() and "doubled_test" not in default_kinds()
    vecs = kind_vectors(SteerConfig(kinds="doubled_test,diff_means"), _ctx())
    assert [v.kind for v in vecs] == ["diff_means", "doubled_test"]
    # in the config's unit (resid) every kind gets the same norm, the layer's mean residual norm
    assert vecs[0].norm == pytest.approx(vecs[1].norm, rel=1e-6) == pytest.approx(vecs[0].resid_norm, rel=1e-6)
    assert "doubled_test" in cli_steer.build_parser().format_help()
    with pytest.raises(UsageError, match="registered twice"):
        register_vector_kind("doubled_test")(lambda ctx: None)


def test_a_builder_that_returns_the_wrong_kind_is_named(monkeypatch):
    monkeypatch.setattr(kind_registry, "_KINDS", dict(kind_registry._KINDS))
    register_vector_kind("liar_test")(lambda ctx: ctx.reference)
    with pytest.raises(TypeError, match="liar_test"):
        kind_vectors(SteerConfig(kinds="liar_test"), _ctx())
