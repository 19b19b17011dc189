"""Cost per item: one boundary forward pass vs sampling k user turns and judging them."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mechprobe.io import read_json


def cost_summary(probe_timing: Mapping[str, Any] | None, cache_timing: Mapping[str, Any] | None,
                 judge_timing: Mapping[str, Any] | None, k: float) -> dict[str, Any]:
    """Seconds per item: one forward pass to the boundary vs sampling ``k`` user turns and judging them.

    Inputs are the cumulative timings the stages record (``user_seconds``/``user_rows`` in the run
    manifest, ``forward_seconds``/``forward_prompts`` in the activation manifest, ``seconds``/``rows``
    in the judge manifest). The forward time covers every cached layer; the generation time per turn
    averages greedy and sampled turns (same token cap). Missing timings give None with a reason.
    """
    def per(t: Mapping[str, Any] | None, s: str, n: str) -> float | None:
        if not t or not t.get(n) or t.get(s) is None:
            return None
        return float(t[s]) / float(t[n])

    fwd = per(cache_timing, "forward_seconds", "forward_prompts")
    gen = per(probe_timing, "user_seconds", "user_rows")
    jud = per(judge_timing, "seconds", "rows")
    out: dict[str, Any] = {"k": float(k), "boundary_forward_s_per_item": fwd,
                           "sample_s_per_item": None if gen is None else gen * k,
                           "judge_s_per_item": None if jud is None else jud * k}
    missing = [n for n, v in (("cache forward timing", fwd), ("user-turn generation timing", gen),
                              ("judge timing", jud)) if v is None]
    if fwd and gen is not None:
        total = gen * k + (jud * k if jud is not None else 0.0)
        out["generate_and_judge_s_per_item"] = total
        out["ratio"] = total / fwd
    else:
        out["ratio"] = None
    if missing:
        out["missing"] = (f"not recorded for this run: {', '.join(missing)} (stages run by an older mechprobe, or "
                          "reused without new rows)")
    return out


def run_cost(run: Path, k: float) -> dict[str, Any]:
    """:func:`cost_summary` from the timings the run's stages recorded."""

    def get(p: Path) -> dict[str, Any] | None:
        return read_json(p).get("timing") if p.exists() else None

    return {"run": str(run), **cost_summary(get(run / "manifest.json"), get(run / "activations" / "manifest.json"),
                                            get(run / "labels_manifest.json"), k)}
