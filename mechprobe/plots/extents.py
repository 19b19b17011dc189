"""Error-bar extents from intervals, and the guard that keeps a failing figure from costing a run its output.

Why one helper for every error bar: matplotlib draws ``errorbar``/``bar(yerr=...)`` from extents (point minus
lower bound, upper bound minus point) and refuses a negative one. An interval whose bound misses its point by
floating-point noise (statsmodels' Wilson bound 1.4e-17 at 0/13) or a percentile bootstrap interval that
excludes its point would end the command with a traceback after every result was computed. :func:`yerr`
clips each extent at 0, so the bar covers the interval and its point: where a point lies outside its
interval, the bar reaches from the point to the far bound (never narrower than the interval, and the point
is still drawn where it is). Missing values (NaN, a rate of nothing) draw no bar.

Why a guard: a figure is the last thing a command writes, after every result file; :func:`draw_figure`
turns a plotting failure into one line naming the figure (the result files are on disk by then), so a
command never ends in a traceback after minutes of work for the sake of a picture.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["draw_figure", "yerr"]


def yerr(points: Sequence[float], lows: Sequence[float], highs: Sequence[float]) -> np.ndarray:
    """``[[point - low, ...], [high - point, ...]]`` for matplotlib's ``yerr``, every extent clipped at 0.

    Args:
        points: the estimates; lows, highs: their interval bounds (one each per point).
    Returns:
        a ``(2, n)`` array of finite, non-negative extents; 0 where a value is missing (NaN or None).
    Example:
        >>> yerr([0.0, 0.5], [1.4e-17, 0.4], [0.23, 0.7]).tolist()
        [[0.0, 0.09999999999999998], [0.23, 0.19999999999999996]]
    """
    p, lo, hi = (np.asarray([np.nan if v is None else v for v in xs], dtype=float) for xs in (points, lows, highs))
    if not (p.shape == lo.shape == hi.shape) or p.ndim != 1:
        raise ValueError(f"yerr needs one low and one high per point, got {p.shape}, {lo.shape}, {hi.shape}")
    with np.errstate(invalid="ignore"):
        ext = np.vstack([p - lo, hi - p])
    return np.where(np.isfinite(ext), np.maximum(ext, 0.0), 0.0)


def draw_figure(out: str | Path, draw: Callable[[], Any]) -> tuple[Path | None, str]:
    """Run ``draw`` (which writes the figure ``out``); a failure becomes one line naming ``out``, not a traceback.

    Call it after every result file is written. Why catch everything: the numbers are on disk by then and the
    figure is a view of them, so a plotting bug must not end a finished run in a traceback; the line names the
    figure, the error and where it was raised, for a bug report, and the caller exits non-zero with it.

    Args:
        out: the figure's path, as ``draw`` writes it.
        draw: a call of a plot function, e.g. ``lambda: plot_steering(rows, out, title)``.
    Returns:
        ``(out, "")`` when drawn, ``(None, line)`` when not: the line starts ``figure not drawn:``.
    Example:
        >>> draw_figure("f.png", lambda: 1 / 0)[1].startswith("figure not drawn: f.png (ZeroDivisionError")
        True
    """
    try:
        draw()
        return Path(out), ""
    except Exception as e:  # noqa: BLE001  any plotting failure: the results are already written
        frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
        msg = " ".join(str(e).split())[:300]
        return None, (f"figure not drawn: {out} ({type(e).__name__}{where}: {msg}); every result file was written "
                      "before it; this is a bug worth reporting")
