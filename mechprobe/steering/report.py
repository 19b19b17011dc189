"""Markdown of the steering experiment: the selection on train items (select.md) and the held-out table (results.md)."""

from __future__ import annotations

from typing import Any

from mechprobe.audit.estimate import Estimate
from mechprobe.audit.rates import cells as rate_cells
from mechprobe.audit.rates import headers as rate_headers
from mechprobe.records import truncation_note
from mechprobe.splits import ItemSplit


def select_md(sel: dict, unit: str, judge_name: str) -> str:
    ch = sel["chosen"]
    lines = [f"# Steering setting chosen on train items ({len(sel['items'])} items, judge {judge_name})", "",
             f"Rule: highest train follow-up rate among settings with degeneration <= {sel['max_degenerate']:g}; "
             "ties to less degeneration, then smaller |alpha|. alpha in "
             f"{'x mean residual norm' if unit == 'resid' else 'x raw difference of means'}.", "",
             f"**Chosen: layer {ch['layer']}, alpha {ch['alpha']:g}**"
             + ("" if sel["cap_met"] else f" (NO setting met the degeneration cap {sel['max_degenerate']:g}: "
                                          "this is the least degenerate one, not a working setting)"), "",
             f"Unsteered on the same train items: follow-up {sel['train_alpha0']['followup_rate']:.3f}, "
             f"degenerate {sel['train_alpha0']['degenerate_rate']:.3f}", "",
             "| layer | alpha | resid norm | \\|delta\\| | follow-up [95% CI] | degenerate [95% CI] "
             "| mean NLL (steered text) |", "|---|---|---|---|---|---|---|"]
    for r in sel["sweep"]:
        nll = f"{r['mean_nll']:.2f}" if r["mean_nll"] is not None else "n/a"
        lines.append(f"| {r['layer']} | {r['alpha']:g} | {fmt(r.get('resid_norm'), '.4g')} "
                     f"| {fmt(r.get('delta_norm'), '.4g')} | {r['followup_rate']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] "
                     f"| {r['degenerate_rate']:.3f} [{r['degenerate_ci'][0]:.3f}, {r['degenerate_ci'][1]:.3f}] "
                     f"| {nll} |")
    by_layer: dict[tuple[int, float], list[float]] = {}
    for r in sel.get("skipped", []):
        by_layer.setdefault((r["layer"], r["broke_at"]), []).append(r["alpha"])
    if by_layer:
        lines += ["", "Not run (degeneration past the cap at a smaller alpha on the same layer; "
                      "`sweep_past_break=True` runs them): "
                  + "; ".join(f"layer {la} alpha {', '.join(f'{x:g}' for x in xs)} (broke at {b:g})"
                              for (la, b), xs in by_layer.items())]
    return "\n".join(lines) + "\n"


def fmt(x, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def _est_cells(r: dict, name: str, audited: bool) -> list[str]:
    """Judge-only (and, audited, corrected) cells of ``r[name + "_judge_only"]`` / ``_corrected``; n/a if absent."""
    j, c = r.get(f"{name}_judge_only"), r.get(f"{name}_corrected")
    if j is None:
        return ["—"] * (2 if audited else 1)
    return rate_cells(_estimate(j), _estimate(c) if c is not None else None) + (["n/a"] if audited and c is None else [])


def _estimate(d: dict) -> Estimate:
    return Estimate(**{k: (float("nan") if v is None and k in ("point", "lo", "hi") else v) for k, v in d.items()})


def results_md(rows: list[dict], header: str, unit: str, audited: bool = False) -> str:
    u = "x resid norm" if unit == "resid" else "x raw diff-of-means"
    heads = (rate_headers("genuine follow-up", audited) + rate_headers("difference vs alpha 0 (same items)", audited))
    lines = [header, "",
             f"| vector | alpha ({u}) | \\|delta\\| (x resid) | genuine follow-up [95% CI] | vs alpha 0: +/- items, "
             "McNemar p | degenerate [95% CI] | NLL unsteered text, steered model | NLL steered text, unsteered "
             "model | task accuracy (vector on) | stock template turns | genuine, template turns not counted | "
             "labels | " + " | ".join(heads) + " |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(heads)]
    for r in rows:
        labs = ", ".join(f"{k} {c}" for k, c in sorted(r["labels"].items(), key=lambda kv: -kv[1]))
        m = r["mcnemar"]
        lines.append(
            f"| {r['kind']} | {r['alpha']:g} | {r['delta_norm']:.4g} ({fmt(r['delta_over_resid'], '.3f')}) "
            f"| {r['followup_rate']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] "
            f"| +{m['b']} / -{m['c']}, p={m['p']:.3g} "
            f"| {r['degenerate_rate']:.3f} [{r['degenerate_ci'][0]:.3f}, {r['degenerate_ci'][1]:.3f}] "
            f"| {fmt(r['nll_unsteered_text'])} | {fmt(r['mean_nll'])} | {fmt(r['task_accuracy'], '.3f')} "
            f"| {fmt(r.get('template_rate'), '.3f')} | {fmt(r.get('followup_rate_strict'), '.3f')} | {labs} | "
            + " | ".join(_est_cells(r, "followup", audited) + _est_cells(r, "diff_vs_alpha0", audited)) + " |")
    return "\n".join(lines) + "\n"


def results_header(*, layer: int, positions: str, n_heldout: int, judge: str, unit: str, resid_norm: float,
                   vector: str, n_selection: int | None, split: ItemSplit | None, n_cut: int, include_truncated: bool,
                   audit: Any, nll_dtype: str, n_acc: int) -> str:
    """The paragraph above the held-out table: the setting, where items came from, truncation, audit, NLLs."""
    return (f"layer {layer}, positions {positions}, {n_heldout} held-out items, judge {judge}, alpha unit "
            f"{unit} (mean boundary residual norm {resid_norm:.4g} on train rows); {vector}"
            + (f"; (layer, alpha) chosen on {n_selection} train items (select.md)" if n_selection is not None else "")
            + (f"; items of split {split.name} ({split.display_path})" if split is not None
               else "; hash split of the run's items")
            + f"\n\n{truncation_note(n_cut, n_heldout, include_truncated)}"
            + ("" if include_truncated else " (their user turns are left out of every rate and paired test)")
            + (f"; corrected = audit {audit.sample_id} ({len(audit)} audited turns, labellers "
               f"{', '.join(audit.labellers)}), PPI++ via mechprobe.audit" if audit is not None
               else "; no audit labels for this steering directory: judge only")
            + f"; NLLs by the HF model in {nll_dtype}"
            + f"\n\ntask accuracy: assistant turn with the vector on at every position, first {n_acc} held-out "
              "items; McNemar: paired exact test vs alpha 0 on the same items (+ genuine only when steered, "
              "- genuine only unsteered)")
