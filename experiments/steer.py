"""Steering vectors that raise genuine follow-ups under greedy decoding, with controls.

    python experiments/steer.py                   # embedded default: (layer, alpha) chosen on train items, then held out
    python experiments/steer.py --alpha 4         # the same, the train sweep's ladder running up to 4 x resid norm
    python experiments/steer.py --no-select-on-train --run runs/smol-gsm8k --layer 12 --alpha-unit raw --alpha 0 1 2 4

By default (layer, alpha) are chosen on train items only (``--select-on-train``: the diff-of-means vector at
each candidate layer x each nonzero alpha on ``--select-items`` train items, judged), and held-out items are
steered only at the chosen setting, for every vector kind. ``--no-select-on-train`` runs every alpha held out.

``--alpha-unit resid`` (default): alpha is the added vector's norm as a multiple of the mean residual norm
at the steered layer (train boundary states), the same for every vector kind; ``raw``: alpha multiplies
the raw difference-of-means vector (CAA convention). See docs/steering.md.

Writes ``<run>/steering/alpha_0_none.jsonl`` (unsteered held-out turns) and
``<run>/steering/L<layer>_<positions>_<unit>/alpha_<a>_<kind>.jsonl`` (steered, judged), ``results.json`` /
``results.md``, ``select.json`` / ``select.md`` (unless ``--no-select-on-train``) and
``<run>/figures/steer_<run>.png``.

An existing ``--run`` is resolved exactly like ``experiments/linear_probe.py`` does it
(:func:`mechprobe.stages.resolve_run`): its own data file, item count, system prompt and token caps,
so nothing is added to it and alpha 0 reproduces its greedy turns.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm import tqdm

# A fresh clone runs without `pip install -e .` too: the package sits next to this folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mechprobe import chat  # noqa: E402
from mechprobe.activations import ActivationCache  # noqa: E402
from mechprobe.cli import accept_negative_numbers, friendly  # noqa: E402
from mechprobe.errors import UserError  # noqa: E402
from mechprobe.io import JsonlStore, read_json, read_jsonl, write_json  # noqa: E402
from mechprobe.judge import JudgeInput, make_judge  # noqa: E402
from mechprobe.models import load_model, native_bf16_dtype  # noqa: E402
from mechprobe.plots import plot_steering  # noqa: E402
from mechprobe.probes import figures_dir  # noqa: E402
from mechprobe.records import AssistantRecord  # noqa: E402
from mechprobe.stages import Stages, auto_judge, ensure_stages, finding_preset, resolve_run  # noqa: E402
from mechprobe.steer_eval import (  # noqa: E402
    NllScorer,
    SteeredTurn,
    assistant_accuracy,
    genuine_by_item,
    paired_vs_base,
    select_on_train,
    split_of,
    steered_user_turns,
    summarize,
    train_probe_direction,
)
from mechprobe.steering import SteeringVector, diff_of_means, from_direction, in_alpha_units  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


KINDS = ("diff_means", "random", "negative", "probe")
# Default alphas per unit. In resid units a ladder from a gentle 5% of the residual norm up to 80% (where
# small models' text usually breaks), so one run shows the rate rise or the text break; in raw units the
# CAA convention's customary single push.
DEFAULT_ALPHAS = {"resid": [0.0, 0.05, 0.1, 0.2, 0.4, 0.8], "raw": [4.0]}


# The generation engine for steered turns, set once in main() (None: the HF model with hooks). A module
# global rather than another argument threaded through run_condition and the train-selection runner.
GEN_ENGINE: dict[str, object] = {}


def resid_ladder(end: float) -> list[float]:
    """The default resid ladder cut at ``end``, extended by doublings up to it, ending exactly at ``end``.

    Why: ``--alpha 4`` used to mean 4 class gaps (CAA); in resid units it is a push four times the size of
    the residual itself, which breaks the text. Run alone it would say only "broken"; as the end of a
    ladder it shows where the follow-up rate rises (if it does) and where the text breaks.
    """
    if end <= 0:
        raise UserError(f"a single --alpha in resid units is the end of the sweep and must be > 0, got {end:g}")
    ladder = [x for x in DEFAULT_ALPHAS["resid"] if x < end]
    while ladder[-1] * 2 < end and ladder[-1] > 0:
        ladder.append(round(ladder[-1] * 2, 6))
    return ladder + [end]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the run's model, else the embedded default model")
    p.add_argument("--dataset", default=None, help="default: the run's dataset, else the main job's")
    p.add_argument("--run", default=None, help="run directory (default runs/<model>-<dataset>)")
    p.add_argument("--new", action="store_true",
                   help="--run names a run to build (from nothing): without it a --run that is not a run yet is "
                        "refused, so a mistyped path does not start a full build; the default run is always built")
    p.add_argument("--judge", default="auto",
                   help="auto (default: the judge of the run's labels; else offline for the embedded default model, "
                        "hybrid2:qwen2.5-coder-1.5b-instruct for other models) | offline | hybrid2:MODEL | openai:MODEL")
    p.add_argument("--engine", default=None, choices=["hf", "llamacpp", "vllm"],
                   help="engine for the probe stage when the run must be built (default: hf for the embedded default "
                        "model; for other models llamacpp when installed on a CPU, else hf)")
    p.add_argument("--steer-engine", default="auto", choices=["auto", "hf", "llamacpp"],
                   help="engine for the steered turns: auto (default: llamacpp when the run was generated by it, else "
                        "hf), hf (hooks) or llamacpp (GGUF models: rows decoded "
                        "together, the vector added by llama.cpp control vectors at the same residual index and "
                        "positions; several times faster on a CPU). Vectors, NLLs and caching stay on HF")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="HF weights dtype when the run must be built (default: the run's own)")
    p.add_argument("--layer", type=int, default=None, help="residual index; default: chosen on train items")
    p.add_argument("--candidate-layers", type=int, nargs="+", default=None,
                   help="layers swept on train items (default: top probe layers, else L/3, L/2, 2L/3)")
    p.add_argument("--alpha", type=float, nargs="+", default=None,
                   help="alphas in --alpha-unit (default: resid 0 0.05 0.1 0.2 0.4 0.8; raw 4). In resid "
                        "units one value is the END of that ladder (--alpha 4: 0 0.05 .. 0.8 1.6 3.2 4); give "
                        "two or more values to run exactly those")
    p.add_argument("--alpha-unit", default="resid", choices=["resid", "raw"],
                   help="resid: alpha x mean residual norm at the layer, equal for every kind (default); "
                        "raw: alpha x the raw difference-of-means vector (CAA)")
    p.add_argument("--select-on-train", action=argparse.BooleanOptionalAction, default=True,
                   help="choose (layer, alpha) on --select-items train items, then run only alpha 0 and the chosen "
                        "alpha held out (default). --no-select-on-train: every alpha runs held out, at --layer or at "
                        "the layer best on train items at the largest alpha")
    p.add_argument("--select-items", type=int, default=None,
                   help="train items judged per swept setting (default: 32 for models other than the embedded "
                        "default, whose findings need it: 16 items give each rate a CI of +/-0.22 and the choice "
                        "among ~20 settings did not replicate held out; 16 for the embedded default)")
    p.add_argument("--sweep-past-break", action="store_true",
                   help="run every swept alpha; by default a layer's larger alphas are skipped once its train "
                        "degeneration exceeds --max-degenerate (they cannot be chosen)")
    p.add_argument("--max-degenerate", type=float, default=0.2,
                   help="selection ignores settings whose train degeneration rate exceeds this")
    p.add_argument("--positions", default="boundary+generated",
                   choices=["boundary", "generated", "boundary+generated", "all"])
    p.add_argument("--kinds", default="diff_means,random,negative,probe")
    p.add_argument("--acc-kinds", default="diff_means,probe",
                   help="kinds whose task accuracy with the vector on is measured at each alpha")
    p.add_argument("--acc-items", type=int, default=24, help="held-out items scored for task accuracy")
    p.add_argument("--max-user-tokens", type=int, default=None,
                   help="cap of the steered user turns (default: the run's own, so alpha 0 reproduces it)")
    p.add_argument("--max-heldout", type=int, default=None, help="cap held-out items (speed)")
    p.add_argument("--no-assistant-check", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steer-dir", default=None,
                   help="where steered turns and results go (default <run>/steering, or steering_llamacpp)")
    p.add_argument("--figures", default=None,
                   help="folder for the figure (default: <run>/figures; --figures figures publishes into the repo)")
    return accept_negative_numbers(p)


def judge_turns(judge, turns: list[SteeredTurn], by_item: dict[str, AssistantRecord], key: str) -> dict[str, str]:
    inputs = [JudgeInput(record_id=f"{key}|{t.item_id}", prompt=by_item[t.item_id].prompt,
                         response=by_item[t.item_id].response, raw_text=t.raw_text, text=t.text,
                         stop_reason=t.stop_reason, dataset=by_item[t.item_id].dataset, decoding="greedy",
                         item_id=t.item_id) for t in turns]
    bar = tqdm(judge.label_many(inputs), total=len(inputs), desc=f"judge {key}", unit="turn", leave=False)
    return {r.record_id: r.label for r in bar}


def validate_args(a: argparse.Namespace) -> None:
    """Refuse options that would run and give meaningless numbers, before any stage runs."""
    bad = [f"--alpha {x} is not a finite number" for x in (a.alpha or []) if not math.isfinite(x)]
    if a.max_user_tokens is not None and a.max_user_tokens < 1:
        bad.append(f"--max-user-tokens must be >= 1, got {a.max_user_tokens}")
    if a.max_heldout is not None and a.max_heldout < 1:
        bad.append(f"--max-heldout must be >= 1, got {a.max_heldout}")
    if a.select_items is not None and a.select_items < 1:
        bad.append(f"--select-items must be >= 1, got {a.select_items}")
    if a.acc_items < 1:
        bad.append(f"--acc-items must be >= 1, got {a.acc_items}")
    if not 0.0 <= a.max_degenerate <= 1.0:
        bad.append(f"--max-degenerate is a rate in [0, 1], got {a.max_degenerate}")
    if a.alpha_unit == "resid" and a.alpha is not None and len(a.alpha) == 1 and not a.alpha[0] > 0:
        bad.append(f"--alpha {a.alpha[0]:g}: one value in resid units is the end of the sweep and must be > 0 "
                   "(give two or more values, e.g. --alpha 0 -0.4, to run exactly those)")
    if a.select_on_train and a.alpha is not None and not any(x != 0 for x in a.alpha):
        bad.append("choosing (layer, alpha) on train items (the default) needs at least one nonzero --alpha to "
                   "choose from; to run exactly these alphas held out, add --no-select-on-train")
    for la in ([a.layer] if a.layer is not None else []) + (a.candidate_layers or []):
        if la < 0:
            bad.append(f"layer {la} < 0: layers are residual indices 0..n_layers")
    for flag, val in (("--kinds", a.kinds), ("--acc-kinds", a.acc_kinds)):
        unknown = sorted(set(val.split(",")) - set(KINDS) - {""})
        if unknown:
            bad.append(f"{flag} {unknown} unknown; choose from {','.join(KINDS)}")
    if bad:
        raise UserError("; ".join(bad))


def probe_prompt_ids(lm, items, system) -> list[list[int]]:
    return [list(chat.build_probe_prompt(lm.tokenizer, x.prompt, x.response, system=system,
                                         history=x.messages or None).input_ids) for x in items]


def base_token_ids(lm, turn: SteeredTurn) -> list[int]:
    """The alpha-0 turn's tokens (rows of older versions lack them: re-tokenised from the raw text)."""
    if turn.token_ids is not None:
        return list(turn.token_ids)
    return list(lm.tokenizer(turn.raw_text, add_special_tokens=False).input_ids)


def run_condition(lm, judge, vec, alpha, a, items, by_item, path: Path, system=None,
                  base: dict[str, SteeredTurn] | None = None, scorer: NllScorer | None = None
                  ) -> tuple[dict, list[SteeredTurn], dict[str, bool]]:
    """Generate (resuming ``path``), judge and summarise one (vector, alpha) on ``items``.

    With ``base`` (the alpha-0 turns of the same items), each turn also gets ``nll_base_text``: the NLL
    of the unsteered turn under this condition's steered model. Returns the summary, the turns and
    per-item genuine flags (for the paired test against alpha 0).
    """
    steered = vec is not None and alpha != 0
    kind = vec.kind if steered else "none"
    key = f"{kind}|a{alpha:g}"
    store = JsonlStore(path, key="item_id")
    done = {r["item_id"] for r in read_jsonl(path, key="item_id")}
    todo = [x for x in items if x.item_id not in done]
    if todo:
        scorer = scorer or NllScorer(lm)
        t0 = time.perf_counter()
        turns = steered_user_turns(lm, todo, vec if steered else None, alpha, a.positions, a.max_user_tokens,
                                   system=system, engine=GEN_ENGINE.get("engine"), nll=scorer)
        turns = with_base_nll(lm, turns, todo, vec if steered else None, alpha, a.positions, system, base, scorer)
        t1 = time.perf_counter()
        labels = judge_turns(judge, turns, by_item, key)
        print(f"{path.parent.name}/{path.name}: {len(todo)} turns generated + NLLs in {t1 - t0:.0f} s, "
              f"judged in {time.perf_counter() - t1:.0f} s", flush=True)
        for t in turns:
            store.append({**asdict(t), "label": labels.get(f"{key}|{t.item_id}"), "judge": judge.name})
    wanted = {x.item_id for x in items}
    rows = [r for r in read_jsonl(path, key="item_id") if r["item_id"] in wanted]
    turns = [SteeredTurn(**{k: v for k, v in r.items() if k not in ("label", "judge")}) for r in rows]
    missing = [t for t in turns if t.nll_base_text is None]
    if missing and (base is not None or not steered):  # rows of older versions: compute, do not rewrite the file
        fixed = {t.item_id: t for t in with_base_nll(lm, missing, [by_item[t.item_id] for t in missing],
                                                     vec if steered else None, alpha, a.positions, system, base,
                                                     scorer or NllScorer(lm))}
        turns = [fixed.get(t.item_id, t) for t in turns]
    labels = {f"{key}|{r['item_id']}": r["label"] for r in rows if r.get("judge") == judge.name}
    labels.update(other_judge_labels(judge, turns, rows, by_item, key, path))
    res = summarize(turns, labels, key)
    nb = [t.nll_base_text for t in turns if t.nll_base_text is not None]
    res["nll_unsteered_text"] = sum(nb) / len(nb) if nb else None
    return {"kind": kind, "alpha": alpha, **res}, turns, genuine_by_item(turns, labels, key)


def pin_vector(base: Path, vec: SteeringVector, turns_dir: Path | None = None) -> None:
    """Save ``vec`` at ``base`` (.safetensors/.json), or check it equals the one saved there.

    Why: steered turns are stored per (layer, kind, alpha), not per vector. The vector is a difference of means
    over *judged* train rows, so relabelling the run with another judge changes it; turns generated with the old
    vector must then not be reused as if they came from the new one. Tolerance: rtol 1e-4 of the vector's norm,
    far above float summation-order noise of a mean over a few hundred rows, far below any change of labels.
    """
    st = base.with_name(base.name + ".safetensors")
    if st.exists():
        old = SteeringVector.load(base).vector.float()
        new = vec.vector.detach().float().cpu()
        if old.shape != new.shape or float((old - new).norm()) > 1e-4 * max(float(new.norm()), 1e-12):
            raise UserError(f"{st} holds another steering vector than the one built now (the run's labels or cache "
                            f"changed since, e.g. a relabel with another judge), so the turns stored beside it are "
                            f"not this vector's. Pass --steer-dir NEW_DIR for a fresh steering directory, or move "
                            f"{base.parent} aside")
        return
    made = sorted(turns_dir.glob("alpha_*.jsonl")) if turns_dir is not None and turns_dir.is_dir() else []
    if made:
        raise UserError(f"{turns_dir} holds steered turns ({made[0].name}, ...) but no record of the vector that made "
                        f"them (a steering directory from an older version), so they cannot be checked against the "
                        f"vector built now. Pass --steer-dir NEW_DIR, or move {turns_dir} aside")
    vec.save(base)


def other_judge_labels(judge, turns: list[SteeredTurn], rows: list[dict], by_item: dict[str, AssistantRecord],
                       key: str, path: Path) -> dict[str, str]:
    """Labels by ``judge`` for rows another judge labelled (or older rows that do not say which judge did).

    Why: a steering directory outlives its judge (docs/results.md: the 1.5B sweep was re-judged with ``hybrid2:``).
    Reusing the stored label under another ``--judge`` would mix judges silently; regenerating would waste the turns.
    So the turns are judged again, never regenerated, and the verdicts kept in ``<file>.labels.jsonl`` keyed by
    judge and item (resumable; the generation file is never rewritten).
    """
    other = [r for r in rows if r.get("judge") != judge.name]
    if not other:
        return {}
    side_p = path.with_name(path.stem + ".labels.jsonl")
    side = {r["key"]: r["label"] for r in read_jsonl(side_p, key="key")}
    other_ids = {r["item_id"] for r in other}
    need = [t for t in turns if t.item_id in other_ids and f"{judge.name}|{t.item_id}" not in side]
    if need:
        got = judge_turns(judge, need, by_item, key)
        store = JsonlStore(side_p, key="key")
        for t in need:
            lab = got.get(f"{key}|{t.item_id}")
            store.append({"key": f"{judge.name}|{t.item_id}", "item_id": t.item_id, "judge": judge.name,
                          "label": lab})
            side[f"{judge.name}|{t.item_id}"] = lab
    return {f"{key}|{r['item_id']}": side[f"{judge.name}|{r['item_id']}"] for r in other}


def with_base_nll(lm, turns, items, vec, alpha, positions, system, base, scorer: NllScorer) -> list[SteeredTurn]:
    """Fill ``nll_base_text``: at alpha 0 the turn is its own base text; steered, score the base turns."""
    if vec is None:
        return [replace(t, nll_base_text=t.nll) for t in turns]
    if base is None:
        return turns
    have = [(t, x) for t, x in zip(turns, items) if x.item_id in base]
    nlls = scorer(probe_prompt_ids(lm, [x for _, x in have], system),
                  [base_token_ids(lm, base[x.item_id]) for _, x in have], vec, alpha, positions)
    got = {t.item_id: n for (t, _), n in zip(have, nlls)}
    return [replace(t, nll_base_text=got.get(t.item_id)) for t in turns]


def pin_nll_dtype(out_dir: Path, wanted: str | None, legacy: str | None) -> str | None:
    """The dtype of the HF model that scores NLLs in ``out_dir``, pinned in ``nll.json`` on first use.

    Why: one table compares NLLs across conditions, and bf16 and fp32 scores of the same text differ by
    ~0.01 per token (1.5B model), a tenth of the smallest steering effect reported; a resumed run must not
    mix them. A directory with steered turns but no pin was scored by the run's own model (``legacy``).
    ``None`` means the model's default dtype.
    """
    pin = out_dir / "nll.json"
    if pin.exists():
        dt = read_json(pin)["dtype"]
        if dt != wanted:
            print(f"note: NLLs in {out_dir} were scored in {dt or 'the default dtype'}; kept for this run")
        return dt
    dt = legacy if any(out_dir.rglob("alpha_*.jsonl")) else wanted
    write_json(pin, {"dtype": dt})
    return dt


def candidate_layers(a, run: Path, n_layers: int) -> list[int]:
    """--candidate-layers, else the three best probe layers (AUROC, embeddings excluded), else L/3, L/2, 2L/3."""
    cands = a.candidate_layers
    metrics_path = run / "probes" / "metrics.json"
    if cands is None and metrics_path.exists() and read_json(metrics_path).get("status") == "ok":
        per = read_json(metrics_path)["per_layer"]
        cands = [r["layer"] for r in sorted(per, key=lambda r: -r["logreg_auroc"]["value"]) if r["layer"] > 0][:3]
    return list(cands or [n_layers // 3, n_layers // 2, 2 * n_layers // 3])


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
                      "`--sweep-past-break` runs them): "
                  + "; ".join(f"layer {la} alpha {', '.join(f'{x:g}' for x in xs)} (broke at {b:g})"
                              for (la, b), xs in by_layer.items())]
    return "\n".join(lines) + "\n"


def fmt(x, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def results_md(rows: list[dict], header: str, unit: str) -> str:
    u = "x resid norm" if unit == "resid" else "x raw diff-of-means"
    lines = [header, "",
             f"| vector | alpha ({u}) | \\|delta\\| (x resid) | genuine follow-up [95% CI] | vs alpha 0: +/- items, "
             "McNemar p | degenerate [95% CI] | NLL unsteered text, steered model | NLL steered text, unsteered "
             "model | task accuracy (vector on) | labels |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        labs = ", ".join(f"{k} {c}" for k, c in sorted(r["labels"].items(), key=lambda kv: -kv[1]))
        m = r["mcnemar"]
        lines.append(
            f"| {r['kind']} | {r['alpha']:g} | {r['delta_norm']:.4g} ({fmt(r['delta_over_resid'], '.3f')}) "
            f"| {r['followup_rate']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] "
            f"| +{m['b']} / -{m['c']}, p={m['p']:.3g} "
            f"| {r['degenerate_rate']:.3f} [{r['degenerate_ci'][0]:.3f}, {r['degenerate_ci'][1]:.3f}] "
            f"| {fmt(r['nll_unsteered_text'])} | {fmt(r['mean_nll'])} | {fmt(r['task_accuracy'], '.3f')} | {labs} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    t0 = time.time()
    validate_args(a)
    if a.alpha is None:
        alphas = list(DEFAULT_ALPHAS[a.alpha_unit])
    elif a.alpha_unit == "resid" and len(a.alpha) == 1:
        alphas = resid_ladder(a.alpha[0])
        print(f"note: --alpha {a.alpha[0]:g} in resid units is the end of the sweep: alphas "
              f"{' '.join(f'{x:g}' for x in alphas)} (x mean residual norm); give two or more values to run exactly "
              "those, or --alpha-unit raw for the CAA convention")
    else:
        alphas = list(a.alpha)
    if a.alpha_unit == "resid" and any(abs(x) >= 2 for x in alphas):
        print(f"note: alpha {max(alphas, key=abs):g} x resid norm adds a vector that many times as long as the "
              "residual itself, which usually breaks the text (a sweep's end, not a working setting)")
    run, cfg = resolve_run(a.run, a.model, a.dataset, preset=finding_preset(a.model), new=a.new or a.run is None,
                           engine=a.engine, dtype=a.dtype)
    if a.judge == "auto":  # resolved here, not in ensure_stages: the steered turns need the same judge
        a.judge = auto_judge(run, cfg.model)
        print(f"judge: {a.judge} (--judge auto; pass --judge to choose)")
    if a.steer_engine == "auto":
        a.steer_engine = "llamacpp" if cfg.engine == "llamacpp" else "hf"
        print(f"steer engine: {a.steer_engine} (the run's probe engine is {cfg.engine}; --steer-engine to choose)")
    st = Stages(run, cfg)
    ensure_stages(run, cfg, a.judge, stages=st)
    if a.max_user_tokens is None:
        a.max_user_tokens = cfg.max_user_tokens
    elif a.max_user_tokens != cfg.max_user_tokens:
        print(f"note: --max-user-tokens {a.max_user_tokens} differs from the run's {cfg.max_user_tokens}: alpha 0 "
              "will not reproduce the run's own turns")
    # Turns steered on llama.cpp are kept apart from HF-steered ones (other arithmetic, other tokens).
    out_dir = Path(a.steer_dir) if a.steer_dir else run / ("steering_llamacpp" if a.steer_engine == "llamacpp"
                                                           else "steering")
    out_dir.mkdir(parents=True, exist_ok=True)
    if a.steer_engine == "llamacpp":  # steered generation on llama.cpp (rows together, control vectors)
        from mechprobe.llamacpp_backend import load_engine

        GEN_ENGINE["engine"] = load_engine(cfg.model, chat_template=cfg.chat_template)[1]
        # The HF model only scores NLLs here, so it need not match the run's dtype: bf16 where native.
        nll_dtype = pin_nll_dtype(out_dir, native_bf16_dtype() or cfg.dtype, legacy=cfg.dtype)
        if nll_dtype == cfg.dtype:
            lm = st.model()
        else:
            st.lm = None  # the run's model (if the cache stage loaded it) is not needed any more
            lm = load_model(cfg.model, device=cfg.device, dtype=nll_dtype, chat_template=cfg.chat_template)
    else:
        lm = st.model()  # generation and NLLs on the run's own model, so alpha 0 reproduces its turns
    scorer = NllScorer(lm)
    print(f"NLLs: HF model in {scorer.dtype}")
    judge = make_judge(a.judge)
    if a.select_items is None:
        a.select_items = 16 if finding_preset(cfg.model) is None else 32

    cache = ActivationCache.load(run)
    mask = cache.labeled_mask()
    y = cache.labels("genuine")
    train_rows = torch.tensor([split_of(i) == "train" for i in cache.item_ids]) & mask
    pos_rows, neg_rows = train_rows & (y == 1), train_rows & (y == 0)
    print(f"train rows: {int(pos_rows.sum())} genuine / {int(neg_rows.sum())} not (vectors are built from these)")
    if int(pos_rows.sum()) < 2:
        raise UserError(f"only {int(pos_rows.sum())} genuine follow-ups among train rows of {run}: a difference of "
                        f"means needs at least 2. Add items to the run first, e.g. `python experiments/linear_probe.py "
                        f"--run {run} --limit {2 * len(set(cache.item_ids))}` (more samples per item need a new run: "
                        f"`python experiments/linear_probe.py --run NEW_DIR --new --samples {2 * cfg.samples}`), then re-run "
                        f"this script with that --run")

    assistants = [AssistantRecord.from_dict(r) for r in read_jsonl(run / "assistant.jsonl", key="item_id")]
    by_item = {x.item_id: x for x in assistants}
    train_items = [x for x in assistants if split_of(x.item_id) == "train"]
    heldout = [x for x in assistants if split_of(x.item_id) == "heldout"][: a.max_heldout]
    unit = a.alpha_unit

    def vec_at(layer: int) -> SteeringVector:
        # The yardstick (resid_norm) is the mean boundary-residual norm of these same train rows.
        x = cache.resid(layer)
        return diff_of_means(x[pos_rows], x[neg_rows], layer, weight_hash=cache.meta["identity"]["weight_hash"],
                             source_run=str(run), position="boundary")

    def setting_dir(root: Path, layer: int) -> Path:
        return root / f"L{layer}_{a.positions}_{unit}"

    n_layers = cache.meta["n_layers_model"]
    too_deep = [la for la in [a.layer, *(a.candidate_layers or [])] if la is not None and la > n_layers]
    if too_deep:
        raise UserError(f"layers {too_deep} exceed the model's {n_layers} blocks (residual indices 0..{n_layers})")
    sweep, selection = [], None
    if a.select_on_train:
        # (layer, alpha) chosen on train items only; held-out items are never steered before the choice.
        sel_items = train_items[: a.select_items]
        sel_dir = out_dir / "select"
        layers = [a.layer] if a.layer is not None else candidate_layers(a, run, n_layers)
        print(f"selecting on {len(sel_items)} train items: layers {layers} x alphas "
              f"{[x for x in alphas if x != 0]} ({unit} units)")

        def run_setting(items, layer: int, alpha: float) -> dict:
            vec = in_alpha_units(vec_at(layer), unit)
            pin_vector(setting_dir(sel_dir, layer) / "vector_diff_means", vec, setting_dir(sel_dir, layer))
            r, _, _ = run_condition(lm, judge, vec, alpha, a, items, by_item,
                                    setting_dir(sel_dir, layer) / f"alpha_{alpha:g}_diff_means.jsonl", cfg.system,
                                    scorer=scorer)
            print(f"  train L{layer} alpha {alpha:g}: follow-up {r['followup_rate']:.3f} "
                  f"degenerate {r['degenerate_rate']:.3f}")
            return {"alpha_unit": unit, "resid_norm": vec.resid_norm, "delta_norm": abs(alpha) * vec.norm,
                    **{k: r[k] for k in ("n", "genuine", "followup_rate", "ci", "degenerate", "degenerate_rate",
                                         "degenerate_ci", "mean_nll", "labels")}}

        selection = select_on_train(run_setting, sel_items, layers, alphas, a.max_degenerate,
                                    stop_at_break=not a.sweep_past_break)
        base_tr, _, _ = run_condition(lm, judge, None, 0.0, a, sel_items, by_item, sel_dir / "alpha_0_none.jsonl",
                                      cfg.system, scorer=scorer)
        selection.update(train_alpha0={k: base_tr[k] for k in ("n", "followup_rate", "ci", "degenerate_rate")},
                         alpha_unit=unit, positions=a.positions, judge=judge.name)
        layer, alphas = selection["chosen"]["layer"], [0.0, selection["chosen"]["alpha"]]
        write_json(out_dir / "select.json", selection)
        (out_dir / "select.md").write_text(select_md(selection, unit, judge.name))
        if not selection["cap_met"]:
            print(f"WARNING: no swept setting kept train degeneration <= {a.max_degenerate:g}; see select.md")
        print(f"chosen on train: layer {layer}, alpha {alphas[1]:g} (wrote {out_dir}/select.md)")
    elif a.layer is not None:
        layer = a.layer
    else:
        # Layer choice on train items only, at the largest alpha.
        alpha_sel = max(alphas, key=abs)
        for cand in candidate_layers(a, run, n_layers):
            v = in_alpha_units(vec_at(cand), unit)
            turns = steered_user_turns(lm, train_items, v, alpha_sel, a.positions, a.max_user_tokens,
                                       system=cfg.system, engine=GEN_ENGINE.get("engine"), nll=scorer)
            key = f"sweep|L{cand}"
            s = summarize(turns, judge_turns(judge, turns, by_item, key), key)
            sweep.append({"layer": cand, "alpha": alpha_sel, **s})
            print(f"  train sweep layer {cand} alpha {alpha_sel:g}: follow-up {s['followup_rate']:.3f} "
                  f"degenerate {s['degenerate_rate']:.3f}")
        layer = max(sweep, key=lambda r: (r["followup_rate"], -r["degenerate_rate"]))["layer"]
    raw = vec_at(layer)
    resid_norm = raw.resid_norm
    v = in_alpha_units(raw, unit)
    pin_vector(out_dir / f"vector_L{layer}_diff_means", v, setting_dir(out_dir, layer))  # in alpha units: bake(v, alpha) adds what steering added
    print(raw.describe())

    kinds = a.kinds.split(",")
    vectors: list[SteeringVector] = []
    if "diff_means" in kinds:
        vectors.append(v)
    if "random" in kinds:
        vectors.append(in_alpha_units(raw.random_like(a.seed), unit))
    if "negative" in kinds:
        vectors.append(in_alpha_units(raw.negated(), unit))
    if "probe" in kinds:
        vectors.append(in_alpha_units(from_direction(train_probe_direction(cache, layer, train_rows, a.seed), raw,
                                                     kind="probe"), unit))

    base, base_turns, base_g = run_condition(lm, judge, None, 0.0, a, heldout, by_item, out_dir / "alpha_0_none.jsonl",
                                             cfg.system, scorer=scorer)
    base_by_item = {t.item_id: t for t in base_turns}
    acc_store = JsonlStore(out_dir / "accuracy.jsonl", key="cond")
    acc_done = {r["cond"]: r["accuracy"] for r in read_jsonl(out_dir / "accuracy.jsonl", key="cond")}
    n_acc = min(len(heldout), a.acc_items)

    def accuracy(vec: SteeringVector | None, alpha: float) -> float | None:
        if a.no_assistant_check or (vec is not None and vec.kind not in a.acc_kinds.split(",") and alpha != 0):
            return None
        steered = vec is not None and alpha != 0
        cond = (f"{vec.kind}|L{layer}|{unit}|a{alpha:g}|seed{a.seed}|n{n_acc}" if steered else f"none|n{n_acc}")
        if cond not in acc_done:
            acc_done[cond] = assistant_accuracy(lm, heldout[:n_acc], vec if steered else None, alpha,
                                                cfg.max_assistant_tokens, system=cfg.system,
                                                engine=GEN_ENGINE.get("engine"))
            acc_store.append({"cond": cond, "accuracy": acc_done[cond], "n_items": n_acc})
        return acc_done[cond]

    def annotate(r: dict, vec: SteeringVector, alpha: float, g: dict[str, bool]) -> dict:
        dn = abs(alpha) * vec.norm
        return {**r, "kind": vec.kind, "layer": layer, "alpha_unit": unit, "resid_norm": resid_norm,
                "delta_norm": dn, "delta_over_resid": dn / resid_norm if resid_norm else None,
                "raw_alpha_equiv": dn / raw.norm if raw.norm else None,
                "mcnemar": paired_vs_base(g, base_g), "task_accuracy": accuracy(vec, alpha)}

    rows = []
    for vec in vectors:
        rows.append(annotate(base, vec, 0.0, base_g))
        for alpha in sorted(set(alphas) - {0.0}):
            r, _, g = run_condition(lm, judge, vec, alpha, a, heldout, by_item,
                                    setting_dir(out_dir, layer) / f"alpha_{alpha:g}_{vec.kind}.jsonl", cfg.system,
                                    base=base_by_item, scorer=scorer)
            rows.append(annotate(r, vec, alpha, g))
    header = (f"layer {layer}, positions {a.positions}, {len(heldout)} held-out items, judge {judge.name}, alpha unit "
              f"{unit} (mean boundary residual norm {resid_norm:.4g} on train rows); {raw.describe()}"
              + (f"; (layer, alpha) chosen on {len(selection['items'])} train items (select.md)" if selection else "")
              + f"; NLLs by the HF model in {scorer.dtype}"
              + f"\n\ntask accuracy: assistant turn with the vector on at every position, first {n_acc} held-out "
                "items; McNemar: paired exact test vs alpha 0 on the same items (+ genuine only when steered, "
                "- genuine only unsteered)")
    table = results_md(rows, header, unit)
    (out_dir / "results.md").write_text(table)
    write_json(out_dir / "results.json", {"layer": layer, "positions": a.positions, "alpha_unit": unit,
                                          "resid_norm": resid_norm, "alphas": sorted(set(alphas)),
                                          "vector": raw.describe(), "vector_meta": v.meta, "sweep_train": sweep,
                                          "selection": selection, "heldout": rows,
                                          "assistant_accuracy_items": None if a.no_assistant_check else n_acc,
                                          "judge": judge.name, "nll_dtype": scorer.dtype,
                                          "seconds": round(time.time() - t0, 1)})
    xlabel = ("alpha (x mean residual norm at the layer; equal |delta| for every kind)" if unit == "resid"
              else "alpha (multiplies the raw difference-of-means vector)")
    fig = plot_steering(rows, figures_dir(a.figures, run) / f"steer_{run.name}.png",
                        f"{cfg.model} · layer {layer} · {a.positions} · {len(heldout)} held-out items", xlabel=xlabel)
    print("\n" + table + f"\nwrote {out_dir}/results.md, results.json and {fig}")
    return 0


if __name__ == "__main__":
    raise SystemExit(friendly(lambda: main()))
