"""Deterministic train / held-out splits by a stable key (item id, conversation id).

One function, so the steering experiment and post-training split the same way: the same key is always on the
same side, across runs and machines (sha256, not Python's salted ``hash``).
"""

from __future__ import annotations

import hashlib


def split_of(key: str, held_out_fraction: float = 0.5) -> str:
    """``"heldout"`` for about ``held_out_fraction`` of keys, else ``"train"``.

    Args:
        key: an item id or conversation id.
        held_out_fraction: the share of keys held out, in [0, 1].

    Returns:
        ``"heldout"`` or ``"train"``.

    Example:
        >>> split_of("gsm8k-17", 0.5) in ("train", "heldout")
        True
    """
    h = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "heldout" if h < held_out_fraction else "train"
