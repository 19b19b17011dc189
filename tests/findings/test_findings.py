"""mechprobe findings: numbers recomputed from committed audit files, the docs check, and the evidence bundles.

Each test works on a copy of committed files under tmp_path (one audit, not the whole reports/ tree) so it runs in
seconds and can plant a changed label or a wrong quoted number without touching the repository.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from mechprobe.audit.sample import AuditSample
from mechprobe.cli.main import main
from mechprobe.errors import UsageError
from mechprobe.findings import BEGIN, END, Value, build_evidence, check_text, compute_findings, quoted_numbers
from mechprobe.findings.check import check_file
from mechprobe.findings.evidence import EVIDENCE_FIELDS, LABEL_FIELDS

REPO = Path(__file__).resolve().parents[2]
MT = "reports/audit/qwen2.5-coder-1.5b-instruct-mt_bench"


def _copy(tmp: Path, *rels: str) -> Path:
    for rel in rels:
        src, dst = REPO / rel, tmp / rel
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)
    return tmp


@pytest.fixture(scope="module")
def mt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 1.5B MT-Bench audit alone (the labelled set's kappas, slow to bootstrap, are not recomputed)."""
    return _copy(tmp_path_factory.mktemp("repo"), MT)


@pytest.fixture(scope="module")
def set_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The audit and the labelled set that holds its turns' texts."""
    return _copy(tmp_path_factory.mktemp("set"), MT, "reports/labelled_turns/turns.jsonl",
                 "reports/labelled_turns/judges.jsonl", "reports/labelled_turns/labels")


@pytest.fixture(scope="module")
def mt_findings(mt_root: Path):  # noqa: ANN201
    return compute_findings(mt_root)


def test_recomputes_the_committed_audit_numbers_from_the_labels(mt_findings) -> None:  # noqa: ANN001
    """Every turn of the 1.5B MT-Bench audit was audited, so its corrected rates and the labellers' kappa come from
    the committed labels alone, and equal what the committed report.json says."""
    rep = json.loads((REPO / MT / "report.json").read_text())
    for s in ("greedy", "T1"):
        v = mt_findings.values[f"mt_bench_1.5b.{s}.corrected"]
        want = rep["rates"][s]["corrected"]
        assert v.how == "recomputed" and v.n == 60
        assert math.isclose(v.point, want["point"], abs_tol=1e-9)
        assert math.isclose(v.lo, want["lo"], abs_tol=1e-9) and math.isclose(v.hi, want["hi"], abs_tol=1e-9)
        assert mt_findings.values[f"mt_bench_1.5b.{s}.judge_only"].how == "read"
    k = mt_findings.values["mt_bench_1.5b.kappa.labellers.binary"]
    assert math.isclose(k.point, rep["inter_labeller"][0]["binary"]["kappa"], abs_tol=1e-9)
    assert (k.k, k.n) == (rep["inter_labeller"][0]["binary"]["agree"], 120)
    assert math.isclose(k.lo, rep["inter_labeller"][0]["binary"]["lo"], abs_tol=1e-9)
    assert mt_findings.mismatches == []


def test_a_changed_label_changes_the_number_and_is_reported_as_a_mismatch(tmp_path: Path) -> None:
    root = _copy(tmp_path, MT)
    labs = sorted((root / MT / "labels").glob("*.json"))
    s = AuditSample.from_dict(json.loads((root / MT / "sample.json").read_text()))
    docs = [json.loads(p.read_text()) for p in labs]
    by = [{r["row"]: r for r in d["rows"]} for d in docs]
    rid = next(r for r in s.record_ids if "|greedy|" in r
               and all(b[s.row_key(r)]["label"] != "genuine_followup" for b in by))
    for p, d, b in zip(labs, docs, by):  # both labellers now call one more greedy turn genuine
        b[s.row_key(rid)]["label"] = "genuine_followup"
        p.write_text(json.dumps(d))
    f = compute_findings(root)
    rep = json.loads((REPO / MT / "report.json").read_text())
    assert f.values["mt_bench_1.5b.greedy.corrected"].point > rep["rates"]["greedy"]["corrected"]["point"]
    assert any(m.startswith("mt_bench_1.5b.greedy.corrected") for m in f.mismatches)


def test_markdown_table_has_stable_keys(mt_findings) -> None:  # noqa: ANN001
    from mechprobe.findings import findings_json, findings_markdown

    md = findings_markdown(mt_findings)
    v = mt_findings.values["mt_bench_1.5b.greedy.corrected"]
    assert f"| `mt_bench_1.5b.greedy.corrected` | {v.text()} | recomputed |" in md
    js = findings_json(mt_findings)
    assert js["values"]["mt_bench_1.5b.greedy.corrected"]["text"] == v.text()
    assert any("relabel_v2" in n or "post_train" in n for n in mt_findings.notes)  # absent sources are noted


VALUES = {v.key: v for v in (
    Value("a.rate", 3 / 60, 0.0172, 0.1372, 3, 60),
    Value("a.diff", -1 / 60, -0.089, 0.045, signed=True),
    Value("a.kappa", 0.8989, 0.7999, 0.9775, 116, 120, unit=""),
    Value("a.other", 0.5, 0.4, 0.6, 30, 60),
    Value("a.read", 0.1, 0.05, 0.2, 6, 60, how="read", source="x/report.json"),
    Value("a.few", 3 / 18, 0.058, 0.392, 3, 18, items=18),
    Value("a.boot", 0.05, 0.0, 0.125, 3, 60, seed_spread=0.0083),
)}


def _doc(body: str) -> str:
    return f"intro 99.9% is outside the block\n{BEGIN}\n{body}\n{END}\n"


def _bad(text: str, **kw: object) -> list[str]:
    return [str(q) for q in check_text(text, VALUES, "doc.md", **kw) if not q.ok]  # type: ignore[arg-type]


def test_check_passes_on_bound_numbers_and_fails_on_a_planted_one() -> None:
    good = _doc("greedy 3/60 = 5.0% [1.7, 13.7]<!-- =a.rate -->; paired −1.7% [−8.9, 4.5]<!-- =a.diff -->; κ 0.90\n"
                "[0.80, 0.98] (116/120 agree)<!-- = a.kappa --> at `alpha 0.8`, Qwen2.5-Coder-1.5B, 60 items")
    got = check_text(good, VALUES, "doc.md")
    assert got and all(q.ok for q in got), [str(q) for q in got if not q.ok]
    assert {q.kind for q in got} == {"fraction", "percent", "interval", "decimal"}
    assert {q.key for q in got} == {"a.rate", "a.diff", "a.kappa"}
    bad = _bad(_doc("greedy 5.1% [1.7, 13.7]<!-- =a.rate -->, κ 0.91<!-- =a.kappa -->, 4/60<!-- =a.rate --> and "
                    "[1.7, 13.8]<!-- =a.rate -->"))
    assert len(bad) == 4 and all("doc.md:3:" in b for b in bad)
    assert any("5.1%" in b for b in bad) and any("0.91" in b for b in bad) and any("[1.7, 13.8]" in b for b in bad)


def test_a_swapped_number_fails_although_it_is_some_other_finding() -> None:
    """The old rule passed a number equal to *any* key; a bound number must be its own key's value."""
    swapped = _doc("rate 50.0%<!-- =a.rate -->, other 5.0%<!-- =a.other -->; chance 50%<!-- =a.diff -->")
    bad = _bad(swapped)
    assert len(bad) == 3 and all("is not a." in b for b in bad)


def test_a_stale_interval_fails() -> None:
    assert _bad(_doc("3/60 = 5.0% [1.7, 13.7]<!-- =a.rate -->")) == []
    bad = _bad(_doc("3/60 = 5.0% [1.6, 13.7]<!-- =a.rate -->"))
    assert len(bad) == 1 and "interval [1.6, 13.7]" in bad[0] and "a.rate's interval" in bad[0]


def test_a_read_only_number_fails_where_only_recomputed_ones_may_be_quoted() -> None:
    text = _doc("judge 6/60 = 10.0% [5.0, 20.0]<!-- =a.read -->")
    assert _bad(text) == []
    bad = _bad(text, recomputed_only=True)
    assert len(bad) == 3 and all("read from x/report.json" in b for b in bad)


def test_unbound_numbers_unknown_keys_and_empty_markers_fail() -> None:
    bad = _bad(_doc("3/60 = 5.0%<!-- =a.rate --> and then 7.5% with no marker"))
    assert len(bad) == 1 and "7.5%" in bad[0] and "bound to no key" in bad[0]
    bad = _bad(_doc("5.0%<!-- =a.nothing -->"))
    assert len(bad) == 1 and "a.nothing is not one" in bad[0]
    bad = _bad(_doc("5.0%<!-- =a.rate --> <!-- =a.rate -->"))
    assert len(bad) == 1 and "binds no number" in bad[0]


def test_a_block_that_checks_nothing_fails() -> None:
    """A block whose only number is in inline code (or that has none) would pass anything: it fails."""
    for body in ("checked `91` numbers: all match", "no numbers at all", "`5.0%`<!-- =a.rate -->"):
        bad = _bad(_doc(body))
        assert any("checks no number" in b for b in bad), (body, bad)


def test_an_estimate_on_few_items_must_say_so() -> None:
    assert len(_bad(_doc("judge 3/18 = 16.7% [5.8, 39.2]<!-- =a.few -->"))) == 3
    assert _bad(_doc("judge (n < 20\n items) 3/18 = 16.7% [5.8, 39.2]<!-- =a.few -->")) == []
    assert "(n < 20 items: 18)" in VALUES["a.few"].text()


def test_a_bootstrap_spread_is_bound_with_at_spread() -> None:
    assert _bad(_doc("ends move 0.8<!-- =a.boot@spread --> points")) == []
    assert len(_bad(_doc("ends move 0.5<!-- =a.boot@spread --> points"))) == 1
    assert len(_bad(_doc("ends move 0.8<!-- =a.rate@spread --> points"))) == 1  # no bootstrap: no spread


def test_extraction_rule() -> None:
    kinds = quoted_numbers("x `0.77` [link](../a/1.5b/2.0) Qwen2.5 1.5B 3.3–9.2% +15.0% 60 items 0.2–1.6 5.5/60")
    assert [(k, p) for k, _, p in kinds] == [("percent", ("3.3%", "9.2%")), ("percent", ("+15.0%",)),
                                            ("decimal", ("0.2",)), ("decimal", ("1.6",)), ("fraction", ("5.5", "60"))]


def test_unbalanced_markers_are_a_usage_error() -> None:
    with pytest.raises(UsageError, match="never closed"):
        check_text(f"{BEGIN}\n5.0%\n", VALUES)
    with pytest.raises(UsageError, match="without"):
        check_text(f"5.0%\n{END}\n", VALUES)


def test_command_check_exit_codes(mt_root: Path, mt_findings, tmp_path: Path,  # noqa: ANN001
                                  capsys: pytest.CaptureFixture[str]) -> None:
    v = mt_findings.values["mt_bench_1.5b.greedy.corrected"]
    ok, wrong, none = tmp_path / "ok.md", tmp_path / "wrong.md", tmp_path / "none.md"
    ok.write_text(_doc(f"MT-Bench greedy {v.text()}<!-- ={v.key} -->"))
    wrong.write_text(_doc(f"MT-Bench greedy {v.text()}<!-- ={v.key} --> and 18.4%"))
    none.write_text("no block here: 18.4%\n")
    assert main(["findings", "--root", str(mt_root), "--quiet", "--check", str(ok)]) == 0
    assert json.loads((mt_root / "reports/findings.json").read_text())["values"]
    assert main(["findings", "--root", str(mt_root), "--json", "", "--quiet", "--check", str(wrong), str(none)]) == 1
    err = capsys.readouterr().err
    assert "wrong.md:3: percent 18.4%" in err and "none.md: no findings block" in err
    assert main(["findings", "--root", str(tmp_path / "nowhere"), "--json", ""]) == 2


def test_bad_input_is_one_line_and_exit_2_before_the_work(mt_root: Path, tmp_path: Path, monkeypatch,  # noqa: ANN001
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """--json naming a directory and a non-UTF-8 file to check are found before the recomputation starts."""
    import mechprobe.cli.findings as cli

    def boom(*a: object) -> None:
        raise AssertionError("the recomputation started before the input was checked")

    monkeypatch.setattr(cli, "compute_findings", boom)
    (mt_root / "reports" / "adir").mkdir(exist_ok=True)
    assert main(["findings", "--root", str(mt_root), "--json", "reports/adir", "--quiet"]) == 2
    assert "is a directory" in capsys.readouterr().err
    latin = tmp_path / "README.md"
    latin.write_bytes(f"{BEGIN}\nrate 5.0\xe9%\n{END}\n".encode("latin-1"))
    assert main(["findings", "--root", str(mt_root), "--json", "", "--check", str(latin)]) == 2
    assert "is not UTF-8" in capsys.readouterr().err
    assert main(["findings", "--root", str(mt_root), "--json", "", "--check", str(tmp_path)]) == 2


def test_nan_in_a_report_and_a_non_utf8_summary(tmp_path: Path) -> None:
    root = _copy(tmp_path, MT)
    rep_path = root / MT / "report.json"
    rep = json.loads(rep_path.read_text())
    rep["rates"]["greedy"]["judge_only"]["point"] = float("nan")
    rep_path.write_text(json.dumps(rep))  # json writes NaN, as a report of an empty stratum may hold
    f = compute_findings(root)
    assert f.values["mt_bench_1.5b.greedy.judge_only"].k is None
    (root / MT / "judge_summary.md").write_bytes(b"| greedy | 0 | 60 | 5.0% \xff")
    with pytest.raises(UsageError, match="judge_summary.md is not UTF-8"):
        compute_findings(root)


def test_a_mismatch_with_the_committed_report_fails_the_check(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    root = _copy(tmp_path, MT)
    rep_path = root / MT / "report.json"
    rep = json.loads(rep_path.read_text())
    rep["inter_labeller"][0]["binary"]["lo"] += 0.01  # a stale kappa interval in the committed report
    rep_path.write_text(json.dumps(rep))
    v = compute_findings(root).values["mt_bench_1.5b.greedy.corrected"]
    doc = tmp_path / "doc.md"
    doc.write_text(_doc(f"{v.text()}<!-- ={v.key} -->"))
    assert main(["findings", "--root", str(root), "--json", "", "--quiet", "--check", str(doc)]) == 1
    assert "mismatch: mt_bench_1.5b.kappa.labellers.binary" in capsys.readouterr().err


def test_the_stand_in_is_never_called_strict(mt_findings) -> None:  # noqa: ANN001
    """Label files without a strict field give `audited_unflagged` (both genuine, neither borderline), no
    `audited_strict` key; differences get a paired item bootstrap beside the unpaired Newcombe interval."""
    keys = set(mt_findings.values)
    assert "mt_bench_1.5b.greedy.audited_unflagged" in keys
    assert not [k for k in keys if "strict" in k]
    assert "borderline" in mt_findings.values["mt_bench_1.5b.greedy.audited_unflagged"].method


def test_a_strict_field_gives_the_strict_reading(tmp_path: Path) -> None:
    root = _copy(tmp_path, MT)
    for p in sorted((root / MT / "labels").glob("*.json")):
        d = json.loads(p.read_text())
        for r in d["rows"]:
            if r["label"] == "genuine_followup":
                r["strict"] = "yes"
        p.write_text(json.dumps(d))
    f = compute_findings(root)
    assert "mt_bench_1.5b.greedy.audited_strict" in f.values
    assert not [k for k in f.values if "unflagged" in k]
    v = f.values["mt_bench_1.5b.greedy.audited_strict"]  # strict "yes" on every genuine row: both call it genuine
    assert (v.k, v.n) == (10, 60) and "borderline" not in v.method


def test_evidence_bundle_rows_have_every_field(set_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "evidence"
    build_evidence(set_root, out)
    rows = [json.loads(x) for x in (out / "mt_bench_1.5b" / "evidence.jsonl").read_text().splitlines()]
    assert len(rows) == 120
    for r in rows:
        assert set(EVIDENCE_FIELDS) <= set(r), set(EVIDENCE_FIELDS) - set(r)
        assert r["query"] and r["answer"] and r["turn"] and len(r["labels"]) == 2
        assert all(set(LABEL_FIELDS) <= set(lab) for lab in r["labels"].values())
    assert sum(r["judge"] is not None for r in rows) > 0
    # the committed bundle is the same as the one built from committed files
    committed = (REPO / "reports/evidence/mt_bench_1.5b/evidence.jsonl").read_text()
    assert (out / "mt_bench_1.5b" / "evidence.jsonl").read_text() == committed


def test_an_audit_without_texts_gets_a_readme_and_labels(tmp_path: Path) -> None:
    rel = "reports/audit/qwen2.5-coder-0.5b-instruct-mt_bench"
    root = _copy(tmp_path, rel, "reports/labelled_turns/turns.jsonl", "reports/labelled_turns/labels")
    build_evidence(root)
    d = root / "reports/evidence/mt_bench_0.5b"
    assert "Texts not kept" in (d / "README.md").read_text() and not (d / "evidence.jsonl").exists()
    rows = [json.loads(x) for x in (d / "labels.jsonl").read_text().splitlines()]
    assert len(rows) == 120 and all(r["labels"] and r["record_id"] and r["sample_id"] for r in rows)


def _relabel_folder(root: Path, greedy_calls: list[tuple[str, str]]) -> Path:
    """A relabel_v2 folder as scripts/relabel_set.py writes it: key.json, evidence.jsonl, report.json."""
    from mechprobe.stats import wilson
    from mechprobe.stats.clustered import clopper_pearson

    d = root / "reports/relabel_v2/qwen2.5-coder-1.5b-instruct-mt_bench"
    d.mkdir(parents=True)
    (d / "key.json").write_text(json.dumps({"model": "qwen2.5-coder-1.5b-instruct", "dataset": "mt_bench"}))
    rows = [{"turn_id": f"t{i}", "condition": "greedy",
             "labels_v2": {n: {"label": lab, "strict_label": lab} for n, lab in zip(("labeller-a", "labeller-b"), c)}}
            for i, c in enumerate(greedy_calls)]
    (d / "evidence.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def rate(flags: list[bool]) -> dict:
        k, n = sum(flags), len(flags)
        lo, hi = clopper_pearson(k, n, 0.05) if k in (0, n) else wilson(k, n)
        return {"k": k, "n": n, "rate": k / n, "ci": [lo, hi]}

    g = "genuine_followup"
    a, b = [c[0] == g for c in greedy_calls], [c[1] == g for c in greedy_calls]
    cell = {"per_labeller": {"labeller-a": rate(a), "labeller-b": rate(b)},
            "both": rate([x and y for x, y in zip(a, b)]), "either": rate([x or y for x, y in zip(a, b)])}
    rep = {"by_condition": {"greedy": {"n": len(rows), "lenient": cell, "strict": cell, "judge_only": rate(a)}},
           "kappa": {"lenient": {"labellers": 0.5}, "v1_lenient_labellers": 0.4}}
    (d / "report.json").write_text(json.dumps(rep))
    return d


def test_relabel_report_is_recomputed_from_its_evidence(tmp_path: Path) -> None:
    g, n = "genuine_followup", "new_query"
    d = _relabel_folder(tmp_path, [(g, g), (g, n), (n, n), (n, n)])
    f = compute_findings(tmp_path)
    v = f.values["relabel_v2.mt_bench_1.5b.greedy.strict.both"]
    assert (v.k, v.n, v.how) == (1, 4, "recomputed") and f.mismatches == []
    k = f.values["relabel_v2.mt_bench_1.5b.kappa.lenient.labellers"]  # recomputed from the rows, equal to the report
    assert math.isclose(k.point, 0.5) and k.how == "recomputed" and (k.k, k.n) == (3, 4)
    rows = [json.loads(x) for x in (d / "evidence.jsonl").read_text().splitlines()]
    rows[1]["labels_v2"]["labeller-b"]["strict_label"] = g  # the evidence now says 2 of 4 for both, strict
    (d / "evidence.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    f = compute_findings(tmp_path)
    assert f.values["relabel_v2.mt_bench_1.5b.greedy.strict.both"].k == 2
    assert any(m.startswith("relabel_v2.mt_bench_1.5b.greedy.strict.both") for m in f.mismatches)


def test_relabel_without_report_is_skipped_with_a_note(tmp_path: Path) -> None:
    d = _relabel_folder(tmp_path, [("new_query", "new_query")])
    (d / "report.json").unlink()
    f = compute_findings(tmp_path)
    assert not [k for k in f.values if k.startswith("relabel_v2")]
    assert any("relabel_v2.mt_bench_1.5b" in note and "not there yet" in note for note in f.notes)


@pytest.mark.slow
def test_committed_findings_json_is_what_the_committed_files_give() -> None:
    """reports/findings.json is regenerated (`mechprobe findings`) whenever an audit file changes."""
    from mechprobe.findings import findings_json

    now = json.loads(json.dumps(findings_json(compute_findings(REPO))))
    assert now == json.loads((REPO / "reports/findings.json").read_text())


@pytest.mark.slow
def test_the_committed_docs_pass_and_planted_faults_fail(tmp_path: Path) -> None:
    """README.md and the findings docs pass on the committed files; in a copy of the README a swap of two of its
    numbers, a read-only number and a stale interval each fail the check."""
    f = compute_findings(REPO)
    assert f.mismatches == [], f.mismatches
    assert not [k for k in f.values if ".identify." in k]  # answer identification is retired, not a finding
    for rel in ("README.md", "docs/findings.md", "docs/findings_appendix.md"):
        quoted, failures = check_file(REPO / rel, f.values)
        assert quoted and not failures, failures
    text = (REPO / "README.md").read_text()
    rd = "relabel_v2.mt_bench_1.5b"
    greedy, sampled = "8/60 = 13.3% [6.9, 24.2]", "9/60 = 15.0% [8.1, 26.1]"
    assert greedy in text and sampled in text
    plants = {
        "swap": text.replace(greedy, "@@").replace(sampled, greedy).replace("@@", sampled),
        "read": text.replace(f"<!-- ={rd}.greedy.judge_only -->", "<!-- =mt_bench_1.5b.greedy.judge_only -->")
                    .replace("5/18 = 27.8% [12.5, 50.9]", "14/60 = 23.3% [14.4, 35.4]"),
        "stale": text.replace("[6.9, 24.2]", "[6.8, 24.2]"),
    }
    for what, planted in plants.items():
        p = tmp_path / what / "README.md"
        p.parent.mkdir()
        p.write_text(planted)
        assert planted != text and check_file(p, f.values)[1], what
