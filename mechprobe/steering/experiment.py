"""Steering vectors that raise genuine follow-ups under greedy decoding, with controls: the experiment's driver.

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
``<run>/figures/steer_<run>.png``. The whole steer stage holds the steering directory's writer lock
(``<steer dir>.lock``, removed on exit), so a second ``steer`` on the same directory is refused instead of
duplicating rows.

An existing ``--run`` is resolved exactly like ``experiments/linear_probe.py`` does it
(:func:`mechprobe.stages.resolve_run`): its own data file, item count, system prompt and token caps,
so nothing is added to it and alpha 0 reproduces its greedy turns.

The pieces: :mod:`~mechprobe.steering.config` (settings, alphas), :mod:`~mechprobe.steering.setting` (what a
directory freezes), :mod:`~mechprobe.steering.items`, :mod:`~mechprobe.steering.conditions` (one vector x alpha),
:mod:`~mechprobe.steering.statistics`, :mod:`~mechprobe.steering.report` (markdown), :mod:`mechprobe.plots.steering`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mechprobe.activations.cache import ActivationCache
from mechprobe.audit.rates import AuditTruth, audit_truth
from mechprobe.errors import UserError
from mechprobe.io import read_json, write_json, writer_lock
from mechprobe.judges.factory import make_judge, shared_judge_model
from mechprobe.linear.turn import figures_dir
from mechprobe.lm.device import native_bf16_dtype
from mechprobe.lm.llamacpp import load_engine
from mechprobe.lm.models import load_model
from mechprobe.plots.extents import draw_figure
from mechprobe.plots.steering import plot_steering, steering_title
from mechprobe.records import truncated_item_ids
from mechprobe.splits import ItemSplit, load_split
from mechprobe.stages import Stages, auto_judge, ensure_stages, finding_preset, finding_split, resolve_run
from mechprobe.steering.conditions import TaskAccuracy, judge_turns, run_condition
from mechprobe.steering.config import DEFAULT_ALPHAS, SteerConfig, resid_ladder
from mechprobe.steering.evaluate import (
    NllScorer,
    paired_vs_base,
    select_on_train,
    split_of,
    steered_user_turns,
    summarize,
)
from mechprobe.steering.items import SteerItems, steer_items
from mechprobe.steering.report import results_header, results_md, select_md
from mechprobe.steering.setting import (
    SETTING_FILE,
    check_setting,
    freeze_setting,
    pin_nll_dtype,
    pin_vector,
    requested_setting,
)
from mechprobe.steering.statistics import heldout_row
from mechprobe.steering.vector import (
    SteeringVector,
    VectorContext,
    build_vector,
    check_kinds,
    diff_of_means,
    in_alpha_units,
)

__all__ = ["DEFAULT_ALPHAS", "SteerConfig", "SteerResult", "candidate_layers", "kind_vectors", "resid_ladder",
           "run_steer", "steer_experiment"]


@dataclass
class SteerResult:
    """What one ``steer`` run produced: the held-out table (also in ``results.md``) and where the files went."""

    out_dir: Path
    layer: int
    alphas: list[float]
    rows: list[dict[str, Any]]
    table: str
    figure: Path | None
    selection: dict[str, Any] | None = None
    exit_code: int = 0
    figure_error: str = ""  # one line naming the figure when it could not be drawn (exit code 1)

    def summary(self) -> str:
        """The text the command prints at the end: the table and the files written; when the figure could not be
        drawn, the results are still listed and the last line says which figure failed and why."""
        if self.figure_error:
            return (f"\n{self.table}\nwrote {self.out_dir}/results.md and results.json\n"
                    f"mechprobe: error: {self.figure_error}")
        return "\n" + self.table + f"\nwrote {self.out_dir}/results.md, results.json and {self.figure}"


@dataclass
class _Steer:
    """Everything the stages after setup share: settings, run, models, train rows of the vectors, items."""

    a: SteerConfig
    run: Path
    cfg: Any  # the run's ProbeConfig
    out_dir: Path
    split: ItemSplit | None
    lm: Any
    judge: Any
    scorer: NllScorer
    engine: object | None
    cache: ActivationCache
    train_rows: torch.Tensor
    pos_rows: torch.Tensor
    neg_rows: torch.Tensor
    items: SteerItems

    @property
    def unit(self) -> str:
        return self.a.alpha_unit

    def vec_at(self, layer: int) -> SteeringVector:
        """The raw difference of means at ``layer``; its yardstick (resid_norm) is the mean boundary-residual
        norm of these same train rows."""
        x = self.cache.resid(layer)
        return diff_of_means(x[self.pos_rows], x[self.neg_rows], layer,
                             weight_hash=self.cache.meta["identity"]["weight_hash"], source_run=str(self.run),
                             position="boundary")

    def setting_dir(self, root: Path, layer: int) -> Path:
        return root / f"L{layer}_{self.a.positions}_{self.unit}"

    def condition(self, vec: SteeringVector | None, alpha: float, items: list, path: Path,
                  base: dict | None = None) -> tuple[dict, list, dict[str, bool]]:
        return run_condition(self.lm, self.judge, vec, alpha, self.a, items, self.items.by_item, path,
                             self.cfg.system, base=base, scorer=self.scorer, engine=self.engine)


def candidate_layers(a: SteerConfig, run: Path, n_layers: int) -> list[int]:
    """--candidate-layers, else the three best probe layers (AUROC, embeddings excluded), else L/3, L/2, 2L/3."""
    cands = a.candidate_layers
    metrics_path = run / "probes" / "metrics.json"
    if cands is None and metrics_path.exists() and read_json(metrics_path).get("status") == "ok":
        per = read_json(metrics_path)["per_layer"]
        cands = [r["layer"] for r in sorted(per, key=lambda r: -r["logreg_auroc"]["value"]) if r["layer"] > 0][:3]
    return list(cands or [n_layers // 3, n_layers // 2, 2 * n_layers // 3])


def _resolve(a: SteerConfig) -> tuple[SteerConfig, Path, Any, Path, ItemSplit | None]:
    """The run, its config, the steering directory and the item split, and ``a`` with every run-time choice made
    (``auto`` judge and steer engine, split file, train items per setting, user-turn cap): a new config, so the
    caller's object keeps what was asked for."""
    run, cfg = resolve_run(a.run, a.model, a.dataset, preset=finding_preset(a.model), new=a.new or a.run is None,
                           engine=a.engine, dtype=a.dtype)
    chosen: dict[str, Any] = {}
    if a.judge == "auto":  # resolved here, not in ensure_stages: the steered turns need the same judge
        chosen["judge"] = auto_judge(run, cfg.model)
        print(f"judge: {chosen['judge']} (judge auto; set judge to choose)")
    if a.steer_engine == "auto":
        chosen["steer_engine"] = "llamacpp" if cfg.engine == "llamacpp" else "hf"
        print(f"steer engine: {chosen['steer_engine']} (the run's probe engine is {cfg.engine}; set steer_engine "
              "to choose)")
    if a.split_file is None:
        chosen["split_file"] = finding_split(cfg.model, cfg.dataset)
        if chosen["split_file"]:
            print(f"held-out items: {chosen['split_file']} (the committed split for models other than the embedded "
                  "default; set split_file to choose another)")
    if a.select_items is None:
        chosen["select_items"] = 16 if finding_preset(cfg.model) is None else 32
    if a.max_user_tokens is None:
        chosen["max_user_tokens"] = cfg.max_user_tokens
    elif a.max_user_tokens != cfg.max_user_tokens:
        print(f"note: max_user_tokens={a.max_user_tokens} differs from the run's {cfg.max_user_tokens}: alpha 0 "
              "will not reproduce the run's own turns")
    r = replace(a, **chosen)
    # Turns steered on llama.cpp are kept apart from HF-steered ones (other arithmetic, other tokens).
    out_dir = Path(r.steer_dir) if r.steer_dir else run / ("steering_llamacpp" if r.steer_engine == "llamacpp"
                                                           else "steering")
    split = load_split(r.split_file) if r.split_file else None
    if split is not None and split.dataset != cfg.dataset:
        raise UserError(f"split_file={split.path} lists {split.dataset} items but the run's dataset is "
                        f"{cfg.dataset}; pass a split of {cfg.dataset} items or a {split.dataset} run")
    return r, run, cfg, out_dir, split


def _models(a: SteerConfig, st: Stages, cfg: Any, out_dir: Path) -> tuple[Any, NllScorer, Any, object | None]:
    """The HF model (generation and NLLs), its scorer, the judge and the llama.cpp engine when asked for."""
    engine = None
    if a.steer_engine == "llamacpp":  # steered generation on llama.cpp (rows together, control vectors)
        engine = load_engine(cfg.model, chat_template=cfg.chat_template)[1]
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
    judge = make_judge(a.judge, loaded=shared_judge_model(a.judge, lm))  # one copy of the weights per dtype
    return lm, scorer, judge, engine


def _train_rows(run: Path, cfg: Any, cache: ActivationCache, split: ItemSplit | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cache rows the vectors are built from (train, positive, negative): the run's train rows (hash split), or
    with a split file every run row not held out by it; refuses fewer than 2 positives with the fix."""
    mask = cache.labeled_mask()
    y = cache.labels("genuine")
    train_rows = torch.tensor([(i not in split.heldout) if split is not None else split_of(i) == "train"
                               for i in cache.item_ids]) & mask
    pos_rows, neg_rows = train_rows & (y == 1), train_rows & (y == 0)
    print(f"train rows: {int(pos_rows.sum())} genuine / {int(neg_rows.sum())} not (vectors are built from these)")
    if int(pos_rows.sum()) < 2:
        raise UserError(f"only {int(pos_rows.sum())} genuine follow-ups among train rows of {run}: a difference of "
                        f"means needs at least 2. Add items to the run first (`mechprobe probes {run}` with "
                        f"limit={2 * len(set(cache.item_ids))}; more samples per item need a new run, e.g. "
                        f"samples={2 * cfg.samples}), then steer that run")
    return train_rows, pos_rows, neg_rows


def _select(s: _Steer, alphas: list[float], n_layers: int) -> tuple[int, list[float], dict[str, Any]]:
    """(layer, [0, alpha]) chosen on train items only; held-out items are never steered before the choice."""
    a, unit, out_dir = s.a, s.unit, s.out_dir
    sel_items = s.items.train[: a.select_items]
    sel_dir = out_dir / "select"
    layers = [a.layer] if a.layer is not None else candidate_layers(a, s.run, n_layers)
    print(f"selecting on {len(sel_items)} train items: layers {layers} x alphas "
          f"{[x for x in alphas if x != 0]} ({unit} units)")

    def run_setting(items: list, layer: int, alpha: float) -> dict:
        vec = in_alpha_units(s.vec_at(layer), unit)
        pin_vector(s.setting_dir(sel_dir, layer) / "vector_diff_means", vec, s.setting_dir(sel_dir, layer))
        r, _, _ = s.condition(vec, alpha, items, s.setting_dir(sel_dir, layer) / f"alpha_{alpha:g}_diff_means.jsonl")
        print(f"  train L{layer} alpha {alpha:g}: follow-up {r['followup_rate']:.3f} "
              f"degenerate {r['degenerate_rate']:.3f}")
        return {"alpha_unit": unit, "resid_norm": vec.resid_norm, "delta_norm": abs(alpha) * vec.norm,
                **{k: r[k] for k in ("n", "genuine", "followup_rate", "ci", "degenerate", "degenerate_rate",
                                     "degenerate_ci", "mean_nll", "labels")}}

    selection = select_on_train(run_setting, sel_items, layers, alphas, a.max_degenerate,
                                stop_at_break=not a.sweep_past_break,
                                train_ids=set(s.split.train) if s.split is not None else None)
    base_tr, _, _ = s.condition(None, 0.0, sel_items, sel_dir / "alpha_0_none.jsonl")
    selection.update(train_alpha0={k: base_tr[k] for k in ("n", "followup_rate", "ci", "degenerate_rate")},
                     alpha_unit=unit, positions=a.positions, judge=s.judge.name)
    layer, alphas = selection["chosen"]["layer"], [0.0, selection["chosen"]["alpha"]]
    write_json(out_dir / "select.json", selection)
    (out_dir / "select.md").write_text(select_md(selection, unit, s.judge.name))
    if not selection["cap_met"]:
        print(f"WARNING: no swept setting kept train degeneration <= {a.max_degenerate:g}; see select.md")
    print(f"chosen on train: layer {layer}, alpha {alphas[1]:g} (wrote {out_dir}/select.md)")
    return layer, alphas, selection


def _layer_sweep(s: _Steer, alphas: list[float], n_layers: int) -> tuple[int, list[dict[str, Any]]]:
    """Layer choice on train items only, at the largest alpha (``--no-select-on-train`` without ``--layer``)."""
    a = s.a
    by_item = s.items.by_item
    alpha_sel = max(alphas, key=abs)
    sweep = []
    for cand in candidate_layers(a, s.run, n_layers):
        v = in_alpha_units(s.vec_at(cand), s.unit)
        turns = steered_user_turns(s.lm, s.items.train, v, alpha_sel, a.positions, a.max_user_tokens,
                                   system=s.cfg.system, engine=s.engine, nll=s.scorer)
        key = f"sweep|L{cand}"
        r = summarize(turns, judge_turns(s.judge, turns, by_item, key, getattr(s.lm, "name", "")), key,
                      set() if a.include_truncated else truncated_item_ids(by_item[t.item_id] for t in turns))
        sweep.append({"layer": cand, "alpha": alpha_sel, **r})
        print(f"  train sweep layer {cand} alpha {alpha_sel:g}: follow-up {r['followup_rate']:.3f} "
              f"degenerate {r['degenerate_rate']:.3f}")
    return max(sweep, key=lambda r: (r["followup_rate"], -r["degenerate_rate"]))["layer"], sweep


def _vectors(s: _Steer, raw: SteeringVector, layer: int) -> list[SteeringVector]:
    """Every asked-for kind at ``layer`` (the registry, :mod:`mechprobe.steering.kinds`), in alpha units: the vector
    and its controls, in table order."""
    ctx = VectorContext(cache=s.cache, layer=layer, train_rows=s.train_rows, pos_rows=s.pos_rows,
                        neg_rows=s.neg_rows, reference=raw, seed=s.a.seed, model=s.lm, run=s.run)
    return kind_vectors(s.a, ctx)


def kind_vectors(a: SteerConfig, ctx: VectorContext) -> list[SteeringVector]:
    """Every kind of ``a.kinds`` built by its registered builder at ``ctx.layer``, put in ``a.alpha_unit``
    (:func:`in_alpha_units`), in table order: what the held-out stage steers with."""
    return [in_alpha_units(build_vector(kind, ctx), a.alpha_unit) for kind in check_kinds(a.kinds)]


def _heldout(s: _Steer, vectors: list[SteeringVector], raw: SteeringVector, layer: int, alphas: list[float],
             audit: AuditTruth | None) -> tuple[list[dict[str, Any]], int]:
    """Alpha 0 and every (kind, nonzero alpha) on the held-out items: one annotated row each, and the number of
    items scored for task accuracy."""
    a, out_dir, heldout = s.a, s.out_dir, s.items.heldout
    base_path = out_dir / "alpha_0_none.jsonl"
    base, base_turns, base_g = s.condition(None, 0.0, heldout, base_path)
    base_by_item = {t.item_id: t for t in base_turns}
    acc = TaskAccuracy(s.lm, out_dir / "accuracy.jsonl", heldout[: min(len(heldout), a.acc_items)], layer, s.unit,
                       a, s.cfg, s.engine)

    def row(r: dict, vec: SteeringVector, alpha: float, g: dict[str, bool], path: Path) -> dict:
        return heldout_row(r, vec, alpha, layer=layer, unit=s.unit, raw=raw, mcnemar=paired_vs_base(g, base_g),
                           task_accuracy=acc(vec, alpha), run=s.run, audit=audit, path=path, g=g,
                           base_path=base_path, base_g=base_g, seed=a.seed)

    rows = []
    for vec in vectors:
        rows.append(row(base, vec, 0.0, base_g, base_path))
        for alpha in sorted(set(alphas) - {0.0}):
            path = s.setting_dir(out_dir, layer) / f"alpha_{alpha:g}_{vec.kind}.jsonl"
            r, _, g = s.condition(vec, alpha, heldout, path, base=base_by_item)
            rows.append(row(r, vec, alpha, g, path))
    return rows, acc.n_items


def _write_results(s: _Steer, *, layer: int, alphas: list[float], raw: SteeringVector, v: SteeringVector,
                   rows: list[dict], sweep: list[dict], selection: dict | None, n_acc: int, audit: AuditTruth | None,
                   frozen: str, t0: float) -> SteerResult:
    """results.md, results.json and the figure."""
    a, out_dir, split, heldout = s.a, s.out_dir, s.split, s.items.heldout
    cut = truncated_item_ids(s.items.by_item[x.item_id] for x in heldout)
    header = results_header(layer=layer, positions=a.positions, n_heldout=len(heldout), judge=s.judge.name,
                            unit=s.unit, resid_norm=raw.resid_norm, vector=raw.describe(),
                            n_selection=len(selection["items"]) if selection else None, split=split, n_cut=len(cut),
                            include_truncated=a.include_truncated, audit=audit, nll_dtype=s.scorer.dtype,
                            n_acc=n_acc)
    table = results_md(rows, header, s.unit, audited=audit is not None)
    (out_dir / "results.md").write_text(table)
    write_json(out_dir / "results.json", {"layer": layer, "positions": a.positions, "alpha_unit": s.unit,
                                          "resid_norm": raw.resid_norm, "alphas": sorted(set(alphas)),
                                          "vector": raw.describe(), "vector_meta": v.meta, "sweep_train": sweep,
                                          "selection": selection, "heldout": rows,
                                          "assistant_accuracy_items": None if a.no_assistant_check else n_acc,
                                          "judge": s.judge.name, "nll_dtype": s.scorer.dtype,
                                          "split": {"file": split.display_path, "sha256": split.sha256} if split else None,
                                          "setting_sha256": frozen,
                                          "truncated": {"n": len(cut), "of": len(heldout),
                                                        "excluded": not a.include_truncated},
                                          "audit": {"sample_id": audit.sample_id, "n_audited": len(audit),
                                                    "labellers": list(audit.labellers)} if audit else None,
                                          "seconds": round(time.time() - t0, 1)})
    xlabel = ("alpha (x mean residual norm at the layer; equal |delta| for every kind)" if s.unit == "resid"
              else "alpha (multiplies the raw difference-of-means vector)")
    title = steering_title(s.cfg.model, s.judge.name, len(heldout), layer, a.positions)
    # The figure is the last thing written: a plotting failure costs the picture, never the results above.
    fig_path = figures_dir(a.figures, s.run) / f"steer_{s.run.name}.png"
    fig, failed = draw_figure(fig_path, lambda: plot_steering(rows, fig_path, title, xlabel=xlabel))
    return SteerResult(out_dir, layer, sorted(set(alphas)), rows, table, fig, selection, exit_code=1 if failed else 0,
                       figure_error=failed)


def _steer(a: SteerConfig, run: Path, cfg: Any, out_dir: Path, split: ItemSplit | None, st: Stages,
           alphas: list[float], request: dict[str, Any], t0: float) -> SteerResult:
    """The steer stage proper (the caller holds the steering directory's writer lock)."""
    lm, scorer, judge, engine = _models(a, st, cfg, out_dir)
    cache = ActivationCache.load(run)
    rows = _train_rows(run, cfg, cache, split)
    s = _Steer(a, run, cfg, out_dir, split, lm, judge, scorer, engine, cache, *rows,
               steer_items(a, run, cfg, lm, split, out_dir))
    n_layers = cache.meta["n_layers_model"]
    too_deep = [la for la in [a.layer, *(a.candidate_layers or [])] if la is not None and la > n_layers]
    if too_deep:
        raise UserError(f"layer/candidate_layers {too_deep} exceed the model's {n_layers} blocks (residual indices "
                        f"0..{n_layers})")
    sweep: list[dict[str, Any]] = []
    selection = None
    if a.select_on_train:
        layer, alphas, selection = _select(s, alphas, n_layers)
    elif a.layer is not None:
        layer = a.layer
    else:
        layer, sweep = _layer_sweep(s, alphas, n_layers)
    raw = s.vec_at(layer)
    v = in_alpha_units(raw, s.unit)
    # In alpha units: bake(v, alpha) adds what steering added.
    pin_vector(out_dir / f"vector_L{layer}_diff_means", v, s.setting_dir(out_dir, layer))
    print(raw.describe())
    vectors = _vectors(s, raw, layer)
    # The setting is frozen before any held-out item is steered: setting.json is written on the first run and
    # checked on every later one, so held-out numbers in this directory come from one setting only.
    frozen = freeze_setting(out_dir, {**request, "layer": layer, "alphas": sorted({float(x) for x in alphas})})
    print(f"setting frozen in {out_dir / SETTING_FILE} (sha256 {frozen[:12]})")
    audit = audit_truth(run) if out_dir.resolve().parent == run.resolve() else None
    rows, n_acc = _heldout(s, vectors, raw, layer, alphas, audit)
    return _write_results(s, layer=layer, alphas=alphas, raw=raw, v=v, rows=rows, sweep=sweep, selection=selection,
                          n_acc=n_acc, audit=audit, frozen=frozen, t0=t0)


def steer_experiment(a: SteerConfig) -> SteerResult:
    """Build or reuse the run's stages, choose (layer, alpha) on train items, steer held-out items, write results.

    Args:
        a: the experiment's settings; the alphas run are ``a.alphas`` (one resid-unit ``alpha`` is the end of a
            ladder, :attr:`SteerConfig.alphas`). ``a`` is not changed: run-time choices go into a resolved copy.

    Returns:
        The held-out rows, the table and the files written (the command prints :meth:`SteerResult.summary`).

    Raises:
        UserError: among others when another process is steering into the same directory (its writer lock).
    """
    t0 = time.time()
    check_kinds(a.kinds)
    check_kinds(a.acc_kinds, "acc_kinds")
    alphas = a.alphas
    for note in a.alpha_notes():
        print(f"note: {note}")
    a, run, cfg, out_dir, split = _resolve(a)
    request = requested_setting(a, alphas, split)
    check_setting(out_dir, request)  # refuse another setting in this steering directory before anything is generated
    st = Stages(run, cfg)
    ensure_stages(run, cfg, a.judge, stages=st, include_truncated=a.include_truncated)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Two steer commands on one directory would each skip the rows *they* saw at start and both append.
    with writer_lock(out_dir, remove=True):
        return _steer(a, run, cfg, out_dir, split, st, alphas, request, t0)


def run_steer(a: SteerConfig) -> int:
    """:func:`steer_experiment`, printing its summary as the command does; returns the exit code (0)."""
    res = steer_experiment(a)
    print(res.summary())
    return res.exit_code
