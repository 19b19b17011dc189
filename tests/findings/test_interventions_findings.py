"""The intervention study's numbers are recomputed from its committed per-turn files and bound to keys."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

from mechprobe.audit.arms import read_sheet_labels, study_outcome, study_table, table_markdown
from mechprobe.findings.compute import Findings
from mechprobe.findings.interventions import intervention_values, study_key
from mechprobe.study.interventions.sheets import write_sheet

ARMS = ["base", "base_t1", "answer_removed", "steer_audited", "steer_random"]


def _study(root: Path, p_steer: float = 0.5, n: int = 30) -> Path:
    """A committed-looking study folder: sheet key, two labellers' files, one judge's verdicts, table.json."""
    d = root / "reports" / "interventions" / "interventions-0.5b-v9"
    held = d / "heldout"
    rows = [{"turn_id": f"i{k}|{a}", "query": f"q{k}", "answer": f"a{k}", "turn": f"t{k}{a}", "item_id": f"i{k}",
             "arm": a} for k in range(n) for a in ARMS]
    write_sheet(rows, held / "sheet.csv", held / "sheet.key.json", sample_id="S", seed=0)
    key = json.loads((held / "sheet.key.json").read_text(encoding="utf-8"))["rows"]
    rng = random.Random(0)
    truth = {r: rng.random() < (p_steer if m["arm"] == "steer_audited" else 0.05) for r, m in key.items()}
    with (held / "sheet.csv").open(encoding="utf-8", newline="") as f:
        sheet = list(csv.DictReader(f))
    for name, flip in (("labeller-a", 0.0), ("labeller-b", 0.1)):
        out = held / "labels" / f"{name}.csv"
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w", encoding="utf-8", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(sheet[0]))
            w.writeheader()
            for r in sheet:
                g = truth[r["row"]] != (rng.random() < flip)
                w.writerow({**r, "label": "genuine_followup" if g else "new_query", "strict": "yes" if g else "",
                            "borderline": "0"})
    with (held / "verdicts_offline.jsonl").open("w", encoding="utf-8") as f:
        for r in key:
            f.write(json.dumps({"record_id": r, "genuine": truth[r] or rng.random() < 0.2}) + "\n")
    labs = [read_sheet_labels(held / "labels" / f"{n}.csv", "S", set(key)) for n in ("labeller-a", "labeller-b")]
    judges = {"offline": {json.loads(x)["record_id"]: json.loads(x)["genuine"]
                          for x in (held / "verdicts_offline.jsonl").read_text(encoding="utf-8").splitlines()}}
    tab = study_table(key, labs, ARMS, judges=judges)
    tab["study_outcome"] = study_outcome(tab)
    (d / "table.json").write_text(json.dumps(tab), encoding="utf-8")
    return d


def _findings(root: Path) -> Findings:
    out = Findings()
    vals, notes = intervention_values(root)
    for v, committed, where in vals:
        out.add(v)
        out.compare(v, committed, where)
    out.notes += notes
    return out


def test_committed_study_reproduces_under_its_keys(tmp_path):
    _study(tmp_path)
    f = _findings(tmp_path)
    assert not f.mismatches
    pre = f"interventions.{study_key('interventions-0.5b-v9')}"
    assert pre == "interventions.0.5b_v9"
    v = f.values[f"{pre}.steer_audited.strict"]
    assert v.n == 30 and v.lo <= v.point <= v.hi
    assert f.values[f"{pre}.steer_audited.strict.vs_base"].signed
    assert f"{pre}.steer_audited.strict.vs_floor" in f.values and f"{pre}.steer_audited.strict.vs_control" in f.values
    assert f"{pre}.base.strict.labeller-b" in f.values and f"{pre}.kappa.strict.labellers" in f.values
    assert f"{pre}.answer_removed.lenient.judge_kappa.offline" in f.values


def test_a_table_that_does_not_follow_from_the_labels_is_a_mismatch(tmp_path):
    d = _study(tmp_path)
    tab = json.loads((d / "table.json").read_text(encoding="utf-8"))
    tab["arms"]["steer_audited"]["strict"]["rate"] += 0.1  # a table edited by hand, or a label file changed after
    (d / "table.json").write_text(json.dumps(tab), encoding="utf-8")
    f = _findings(tmp_path)
    assert any("steer_audited.strict:" in m for m in f.mismatches)


def test_a_study_still_being_labelled_is_skipped_with_a_note(tmp_path):
    d = _study(tmp_path)
    (d / "table.json").unlink()
    f = _findings(tmp_path)
    assert not f.values and any("no table.json" in n for n in f.notes)


def test_verdict_follows_the_preregistered_tests(tmp_path):
    d = _study(tmp_path, p_steer=0.6, n=60)
    tab = json.loads((d / "table.json").read_text(encoding="utf-8"))
    v = study_outcome(tab)
    assert v["lift"] and v["outcome"].startswith("effect")
    null = _study(tmp_path / "null", p_steer=0.05, n=60)
    v0 = study_outcome(json.loads((null / "table.json").read_text(encoding="utf-8")))
    assert v0["lift"] is False and v0["outcome"] in ("powered null", "inconclusive")
    tab.pop("study_outcome")
    md = table_markdown(tab, "m", "")
    assert "Pre-registered outcome" not in md  # table_markdown states the outcome only once it is in the table
    tab["study_outcome"] = v
    assert "Pre-registered outcome: effect" in table_markdown(tab, "m", "")


def _accuracy(d: Path, scores: dict[str, list[int]]) -> None:
    """Per-answer accuracy files and the runner's summary, as the ``accuracy`` step writes them."""
    from mechprobe.audit.arms import paired_difference

    acc = d / "accuracy"
    acc.mkdir(parents=True, exist_ok=True)
    got = {}
    for m, s in scores.items():
        got[m] = {f"g{i}": bool(x) for i, x in enumerate(s)}
        (acc / f"{m}.jsonl").write_text("".join(json.dumps({"item_id": f"g{i}", "score": float(x)}) + "\n"
                                                for i, x in enumerate(s)), encoding="utf-8")
    models = {m: {"rate": sum(s) / len(s), "n": len(s), **({"vs_base": paired_difference(got["base"], got[m])}
                                                            if m != "base" else {})} for m, s in scores.items()}
    (acc / "accuracy.json").write_text(json.dumps({"metric": "exact_match", "models": models}), encoding="utf-8")


def test_accuracy_is_recomputed_from_the_answers_and_bound(tmp_path):
    d = _study(tmp_path)
    rng = random.Random(1)
    _accuracy(d, {"base": [rng.random() < 0.3 for _ in range(40)], "sft_s0": [rng.random() < 0.5 for _ in range(40)]})
    f = _findings(tmp_path)
    assert not f.mismatches
    v = f.values["interventions.0.5b_v9.accuracy.sft_s0"]
    assert v.n == 40 and v.lo <= v.point <= v.hi
    assert f.values["interventions.0.5b_v9.accuracy.sft_s0.vs_base"].signed
    # an answer rescored after the summary was written no longer reproduces it
    lines = (d / "accuracy" / "sft_s0.jsonl").read_text(encoding="utf-8").splitlines()
    flipped = [json.dumps({**json.loads(x), "score": 1.0 - json.loads(x)["score"]}) for x in lines[:5]]
    (d / "accuracy" / "sft_s0.jsonl").write_text("\n".join(flipped + lines[5:]) + "\n", encoding="utf-8")
    assert any("accuracy.sft_s0" in m for m in _findings(tmp_path).mismatches)
