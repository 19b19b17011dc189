"""The negative control (``negative``): the difference of means pointing the other way."""

from __future__ import annotations

from mechprobe.steering.kind_registry import VectorContext, register_vector_kind
from mechprobe.steering.steering_vector import SteeringVector


@register_vector_kind("negative", order=30, default=True)
def negative(ctx: VectorContext) -> SteeringVector:
    """``-v``: if steering works, the negated vector should lower follow-up."""
    return ctx.reference.negated()
