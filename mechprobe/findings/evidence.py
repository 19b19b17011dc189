"""Evidence bundles: per finding, every audited turn with what the labellers and the judge said about it.

Why: an audit commits record ids and labels keyed by opaque sheet rows; a reader who wants to see *which* turn a
label belongs to, and the turn itself, needs the join done once and committed. Where the labelled set
(``reports/labelled_turns``) holds the audited turns' texts (an audit imported with ``scripts/build_labelled_set.py
--audit``), ``reports/evidence/<finding>/evidence.jsonl`` has one row per audited turn with the query, the full
answer, the turn as written, the judge's verdict where one is committed and each labeller's label, borderline flag
and note. Where the texts are not kept (the run directories are not committed), ``labels.jsonl`` has the same rows
without texts and ``README.md`` says so and lists what is committed. ``reports/relabel_v2/<model>-<dataset>/`` is
its own bundle (``scripts/relabel_set.py`` writes its ``evidence.jsonl``).

Built by ``python scripts/build_evidence.py``; the outputs are committed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mechprobe.audit.labels import LabellerLabels
from mechprobe.audit.sample import AuditSample
from mechprobe.errors import UsageError
from mechprobe.io import read_json

from .compute import (
    AUDITS,
    LABELLED_SET,
    POST_TRAIN,
    POST_TRAIN_AUDITS,
    POST_TRAIN_PREFIX,
    audit_record_item,
    audit_strata,
    load_audit,
)

__all__ = ["EVIDENCE_DIR", "EVIDENCE_FIELDS", "LABEL_FIELDS", "build_evidence", "audit_rows_with_texts"]

EVIDENCE_DIR = "reports/evidence"
# every row of an evidence.jsonl has these keys (labels.jsonl: all but the texts and the labelled set's ids)
EVIDENCE_FIELDS = ("finding", "record_id", "item_id", "condition", "sample_id", "row_key", "turn_id", "split",
                   "query", "answer", "answer_capped", "turn", "judge", "labels")
TEXT_FIELDS = ("turn_id", "split", "query", "answer", "answer_capped", "turn")
LABEL_FIELDS = ("label", "borderline", "note")
HOW = "python scripts/build_evidence.py"
SUPERSEDED = ("**Labels only, superseded.** These label files have no codebook v2 `strict` field, so this audit has "
              "no strict reading; its numbers are in `docs/findings_appendix.md` (labels only, superseded), where "
              "\"both labellers genuine, neither borderline\" is named as such and never called strict.")


def _labels_of(sample: AuditSample, labs: list[LabellerLabels], rid: str) -> dict[str, dict[str, Any]]:
    key = sample.row_key(rid)
    out = {}
    for lab in labs:
        r = lab.by_row().get(key)
        if r is not None:
            out[lab.name] = {"label": r.label, "borderline": r.borderline, "note": r.note}
    return out


def _model_of(folder: str) -> str:
    """``qwen2.5-coder-1.5b-instruct`` from ``reports/audit/qwen2.5-coder-1.5b-instruct-mt_bench``."""
    base = Path(folder).name
    return base.split("-instruct")[0] + "-instruct" if "-instruct" in base else base


def audit_rows_with_texts(root: Path, sample: AuditSample, labs: list[LabellerLabels], model: str
                          ) -> dict[str, dict[str, Any]] | None:
    """record id -> the labelled-set turn it is, or None when some audited turn is not in the labelled set.

    A turn matches when the labelled set has a turn of ``model`` on the same item and decoding, taken from a run
    (``source`` ``run:...``), whose labeller-a and labeller-b labels, flags and notes are the audit's first two
    labellers' (the labelled set imported them from this audit); several T=1 samples of one item are told apart
    by those labels, and a turn that is not uniquely matched leaves the audit without texts.
    """
    d = root / LABELLED_SET
    if not (d / "turns.jsonl").exists() or len(labs) < 2:
        return None
    turns = [json.loads(x) for x in (d / "turns.jsonl").read_text(encoding="utf-8").splitlines() if x.strip()]
    set_labels = [{r["row"]: r for r in read_json(d / "labels" / f"{n}.json")["rows"]}
                  for n in ("labeller-a", "labeller-b")]
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for t in turns:
        if t["model"] == model and str(t.get("source", "")).startswith("run:"):
            by.setdefault((t["item_id"], t["condition"]), []).append(t)
    out: dict[str, dict[str, Any]] = {}
    for rid in sample.record_ids:
        parts = rid.split("|")
        if "#" in rid or len(parts) < 2:
            return None  # a steered turn: the labelled set never holds held-out steering items
        mine = _labels_of(sample, labs, rid)
        want = [mine.get(lab.name) for lab in labs[:2]]
        hits = [t for t in by.get((parts[0], parts[1]), [])
                if all(w is not None and t["turn_id"] in sl
                       and (sl[t["turn_id"]]["label"], bool(sl[t["turn_id"]]["borderline"]), sl[t["turn_id"]]["note"])
                       == (w["label"], w["borderline"], w["note"]) for w, sl in zip(want, set_labels))]
        if len(hits) != 1:
            return None
        out[rid] = hits[0]
    if len({t["turn_id"] for t in out.values()}) != len(out):
        return None
    return out


def _judges(root: Path, judge_name: str) -> dict[str, dict[str, Any]]:
    """turn id -> the committed verdict of the audit's judge (same judge name) from the labelled set's judges.jsonl."""
    p = root / LABELLED_SET / "judges.jsonl"
    out: dict[str, dict[str, Any]] = {}
    if p.exists():
        for x in p.read_text(encoding="utf-8").splitlines():
            if x.strip():
                j = json.loads(x)
                if j.get("judge") == judge_name:
                    out[j["turn_id"]] = {"spec": j.get("spec"), "judge": j["judge"], "label": j["label"]}
    return out


def _rows(name: str, rel: str, sample: AuditSample, labs: list[LabellerLabels],
          texts: dict[str, dict[str, Any]] | None, judges: dict[str, dict[str, Any]],
          extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    stratum = {rid: s for s, rids in audit_strata(sample).items() for rid in rids}
    rows = []
    for rid in sample.record_ids:
        row: dict[str, Any] = {"finding": name, **(extra or {}), "record_id": rid, "item_id": audit_record_item(rid),
                               "condition": stratum[rid], "sample_id": sample.sample_id,
                               "row_key": sample.row_key(rid)}
        if texts is not None:
            t = texts[rid]
            row.update({k: t.get(k) for k in TEXT_FIELDS})
            row["judge"] = judges.get(t["turn_id"])
        row["labels"] = _labels_of(sample, labs, rid)
        rows.append(row)
    return rows


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows), encoding="utf-8")


def _committed(folder: Path, root: Path) -> list[str]:
    return [f"`{p.relative_to(root).as_posix()}`" for p in sorted(folder.rglob("*")) if p.is_file()]


def _describe(sample: AuditSample, labs: list[LabellerLabels]) -> list[str]:
    per = ", ".join(f"{s} {n}" for s, n in sorted(sample.per_stratum.items()))
    return [f"- Sample `{sample.sample_id}`: {len(sample.record_ids)} audited turns by {sample.by} ({per}), "
            f"seed {sample.seed}; judge `{', '.join(sample.judges)}`.",
            "- Labellers: " + "; ".join(f"{lab.name} ({lab.kind}, {len(lab.rows)} labelled, "
                                       f"{sum(r.borderline for r in lab.rows)} borderline)" for lab in labs) + "."]


def _audit_bundle(root: Path, name: str, rel: str, out: Path) -> list[Path]:
    folder = root / rel
    sample, labs = load_audit(folder)
    texts = audit_rows_with_texts(root, sample, labs, _model_of(rel))
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    for stale in ("evidence.jsonl", "labels.jsonl"):
        (d / stale).unlink(missing_ok=True)
    lines = [f"# Evidence: {name}", "", f"Audit: `{rel}/`. Built by `{HOW}` from committed files only.", "",
             *_describe(sample, labs)]
    if texts is not None:
        judges = _judges(root, sample.judges[0] if sample.judges else "")
        rows = _rows(name, rel, sample, labs, texts, judges)
        _write_jsonl(d / "evidence.jsonl", rows)
        n_judge = sum(r["judge"] is not None for r in rows)
        lines += ["", "Texts kept: every audited turn is in the labelled set (`reports/labelled_turns/turns.jsonl`), "
                  "matched on item, decoding and both labellers' labels and notes.", "",
                  "`evidence.jsonl`, one row per audited turn: `record_id` (the run's), `item_id`, `condition` (the "
                  "audit's stratum), `sample_id`, `row_key` (the blind sheet's row), `turn_id` and `split` (the "
                  "labelled set's), `query`, `answer` (in full), `answer_capped`, `turn` (as written, special tokens "
                  "kept), `judge` (`{spec, judge, label}` or null), `labels` (each labeller's `label`, `borderline`, "
                  "`note`).", "",
                  f"Judge verdicts: {n_judge} of {len(rows)} turns have the audit judge's verdict committed (the "
                  "labelled set's `judges.jsonl`, which judged its test split); the others are null, because the "
                  "run's `labels.jsonl` is not committed. The judge's scores are not committed. Judge-only rates "
                  "and judge-vs-labeller kappas of this audit come from its committed `report.json`.", "",
                  f"{SUPERSEDED} Where the same turns were re-labelled under codebook v2 (with the `strict` field), "
                  "that re-labelling (`reports/relabel_v2/`) is the finding."]
    else:
        _write_jsonl(d / "labels.jsonl", _rows(name, rel, sample, labs, None, {}))
        lines += ["", "**Texts not kept.** The audited turns, the answers and the judge's verdict per turn were in "
                  "the run directory, which is not committed (`runs/` is ignored), and the labelled set does not "
                  "hold these turns. What is committed:", "",
                  *[f"- {p}" for p in _committed(folder, root)], "",
                  "`labels.jsonl` (this folder) joins them: one row per audited turn with `record_id`, `item_id`, "
                  "`condition`, `sample_id`, `row_key` and each labeller's `label`, `borderline` and `note`.", "",
                  SUPERSEDED]
    (d / "README.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return sorted(p for p in d.iterdir() if p.is_file())


def _post_train_bundle(root: Path, out: Path) -> list[Path]:
    d = out / POST_TRAIN
    d.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    lines = [f"# Evidence: {POST_TRAIN}", "", f"Post-training audits of qwen2.5-coder-0.5b-instruct. Built by `{HOW}`.",
             "", "**Texts not kept.** The eval and pairs runs (`runs/post_train/...`) are not committed. What is "
             "committed, per audit:"]
    for arm, rel in POST_TRAIN_AUDITS.items():
        folder = root / rel
        if not (folder / "sample.json").exists():
            continue
        sample, labs = load_audit(folder)
        rows += _rows(POST_TRAIN, rel, sample, labs, None, {}, {"arm": arm})
        lines += ["", f"## {arm} (`{rel}/`)", "", *_describe(sample, labs), *[f"- {p}" for p in _committed(folder, root)]]
    manifest = root / f"{POST_TRAIN_PREFIX}_dpo_pairs_manifest.json"
    if manifest.exists():
        m = read_json(manifest)
        c = m.get("counts", {})
        lines += ["", "## DPO pairs", "",
                  f"- `{manifest.relative_to(root).as_posix()}`: {c.get('pairs_used')} pairs used of "
                  f"{c.get('pairs_available')} available ({c.get('turns')} sampled turns of {c.get('items')} items, "
                  f"{c.get('items_with_both')} items with both a judged-genuine and a failure turn).",
                  f"- Training items: {', '.join(m.get('train_item_ids', []))}.",
                  "- The pair ids (which record id was chosen and which rejected in each pair) are **not committed**: "
                  "the manifest keeps counts and items, and `judge_error_on_pairs` keeps the audited shares "
                  "(chosen not genuine, rejected genuine, pairs in the wrong order). The pairs audit "
                  "(`pairs-gsm8k/sample.json`) lists all 128 sampled turns it labelled."]
    _write_jsonl(d / "labels.jsonl", rows)
    lines += ["", "`labels.jsonl` joins each audit's sample and labels: one row per audited turn with `arm`, "
              "`record_id`, `item_id`, `condition`, `sample_id`, `row_key` and each labeller's `label`, `borderline` "
              "and `note`.", "", SUPERSEDED]
    (d / "README.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return sorted(p for p in d.iterdir() if p.is_file())


def build_evidence(root: str | Path = ".", out: str | Path | None = None) -> list[Path]:
    """Write every finding's bundle under ``<root>/reports/evidence`` (or ``out``); returns the files written.

    Example:
        >>> build_evidence(".")  # reports/evidence/mt_bench_1.5b/evidence.jsonl, .../gsm8k_1.5b/README.md, ...  # doctest: +SKIP
    """
    root = Path(root)
    if not (root / "reports").is_dir():
        raise UsageError(f"{root}/reports not found; run from the repository root")
    out = Path(out) if out is not None else root / EVIDENCE_DIR
    written: list[Path] = []
    index = ["# Evidence bundles", "", f"One folder per finding, built by `{HOW}` from committed files. "
             "`mechprobe findings` recomputes the quoted numbers from the same files.", "",
             "| finding | audit | texts |", "|---|---|---|"]
    for name, rel in AUDITS.items():
        if not (root / rel / "sample.json").exists():
            continue
        files = _audit_bundle(root, name, rel, out)
        has = any(p.name == "evidence.jsonl" for p in files)
        index.append(f"| [{name}]({name}/) | `{rel}/` | {'kept (evidence.jsonl)' if has else 'not kept (labels.jsonl)'} |")
        written += files
    written += _post_train_bundle(root, out)
    index.append(f"| [{POST_TRAIN}]({POST_TRAIN}/) | `{POST_TRAIN_PREFIX}_audit/` | not kept (labels.jsonl) |")
    for p in sorted((root / "reports" / "relabel_v2").glob("*/key.json")):
        rel = p.parent.relative_to(root).as_posix()
        index.append(f"| relabel_v2 | `{rel}/` | kept in that folder (`evidence.jsonl`, written by "
                     f"`scripts/relabel_set.py score`) |")
    (out / "README.md").write_text("\n".join(index) + "\n", encoding="utf-8")
    return [*written, out / "README.md"]
