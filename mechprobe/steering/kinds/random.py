"""The random control (``random``): a direction drawn from the seed, orthogonal to and as long as the diff of means."""

from __future__ import annotations

from mechprobe.steering.kind_registry import VectorContext, register_vector_kind
from mechprobe.steering.steering_vector import SteeringVector, random_like


@register_vector_kind("random", order=20, default=True)
def random_direction(ctx: VectorContext) -> SteeringVector:
    """A random direction with the reference's norm (separates "this direction" from "any push this big")."""
    return random_like(ctx.reference, ctx.seed)
