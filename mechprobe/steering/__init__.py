"""Steering vectors that aim to raise greedy follow-up, with controls.

:mod:`.vector` (``SteeringVector``, the vector kinds, ``steer``/``bake`` and ``vec.apply``) · :mod:`.evaluate`
(steered turns, NLLs, paired tests) · :mod:`.config`, :mod:`.setting` (the frozen setting), :mod:`.items`,
:mod:`.conditions`, :mod:`.statistics`, :mod:`.report` and :mod:`.experiment` (the ``steer`` command: layer and
alpha chosen on train items, then every condition on held-out items).
"""

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
