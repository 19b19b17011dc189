"""mechprobe.steering.vector."""

from __future__ import annotations

from mechprobe.steering.vector import (
    KINDS,
    STEER_POSITIONS,
    SteeringVector,
    bake,
    diff_of_means,
    from_direction,
    steer,
)

__all__ = ["KINDS", "STEER_POSITIONS", "SteeringVector", "bake", "diff_of_means", "from_direction", "steer"]
