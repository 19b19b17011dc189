"""The probe vector (``probe``): the logistic probe's direction at the layer, fitted on train rows only."""

from __future__ import annotations

import torch

from mechprobe.linear.turn import directions
from mechprobe.steering.kind_registry import VectorContext, register_vector_kind
from mechprobe.steering.steering_vector import SteeringVector, from_direction


def train_probe_direction(cache: object, layer: int, train_rows: torch.Tensor, seed: int) -> torch.Tensor:
    """The logistic probe's direction at ``layer``, fitted on train rows only.

    Why not ``probes/directions.safetensors``: the probes stage fits those on *all* rows (held-out items
    included), so a vector read from there would have seen the held-out labels it is evaluated on.
    """
    rows = train_rows.nonzero().flatten()
    x = cache.resid(layer)[rows].float().numpy()  # type: ignore[attr-defined]
    yy = cache.labels("genuine")[rows].numpy()  # type: ignore[attr-defined]
    groups = [cache.item_ids[i] for i in rows.tolist()]  # type: ignore[attr-defined]
    tensors, _ = directions(x[:, None, :], [layer], yy, groups, seed=seed)
    return torch.from_numpy(tensors[f"probe_{layer}"])


@register_vector_kind("probe", order=40, default=True)
def probe(ctx: VectorContext) -> SteeringVector:
    """The train-rows probe direction with the reference's norm (:func:`from_direction`), cosine recorded."""
    return from_direction(train_probe_direction(ctx.cache, ctx.layer, ctx.train_rows, ctx.seed), ctx.reference,
                          kind="probe")
