"""The difference-of-means vector (``diff_means``): mean boundary residual of genuine follow-ups minus the rest."""

from __future__ import annotations

from mechprobe.steering.kind_registry import VectorContext, register_vector_kind
from mechprobe.steering.steering_vector import SteeringVector


@register_vector_kind("diff_means", order=10, default=True)
def diff_means(ctx: VectorContext) -> SteeringVector:
    """The raw difference of means over the train rows (the context's reference vector itself)."""
    return ctx.reference
