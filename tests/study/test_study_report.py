"""The study report as a pure function of run directories (synthetic runs written to tmp_path), the claims
table's decision rules on synthetic aggregates, and skipping models whose weights are not fetched."""

from __future__ import annotations

import pytest

from mechprobe.cli.study import main
from mechprobe.stats import Rate, paired_bootstrap
from mechprobe.study import report as sr
from mechprobe.study.report import Verdict
from mechprobe.study.run import StudyConfig, run_study
from tests.study_helpers import write_synthetic_run

G = "genuine_followup"
N = "new_query"
D = "empty_or_degenerate"


def _items(n: int, greedy: str, sample: list[str], score_every: int = 2, prefix: str = "gsm8k") -> dict:
    return {f"{prefix}-{i:04d}": {"score": float(i % score_every == 0), "stop": "max_tokens" if i == 0 else "end_of_turn",
                                  "turns": [("greedy", 0.0, greedy, "end_of_turn")]
                                  + [("sample", 1.0, lab, "end_of_turn") for lab in sample]
                                  + [("sample", 1.3, D, "max_tokens")]}
            for i in range(n)}


def make_root(root):
    for model, greedy_lab, samples in (("smollm2-135m-instruct", N, [G, N]), ("qwen2.5-coder-0.5b-instruct", N, [G, G])):
        for ds in ("gsm8k", "hh_rlhf"):
            run = write_synthetic_run(root / model / ds, ds, _items(6, greedy_lab, samples, prefix=ds), model=model,
                                      config={"engine": "hf", "max_assistant_tokens": 64, "max_user_tokens": 16,
                                              "samples": 2})
            write_synthetic_run(run / "variants" / "swap", ds, _items(6, N, [N, N], prefix=ds), variant="swap",
                                model=model)
            (run / sr.STAGES).write_text('{"id": "probe#0", "stage": "probe", "seconds": 12.5, "new_rows": 30}\n')
    write_synthetic_run(root / sr.HUMAN_DIR / "hh_rlhf", "hh_rlhf",
                        {f"hh_rlhf-{i:04d}": {"score": None, "turns": [("human", 0.0, G if i % 2 else N, "end_of_turn")]}
                         for i in range(6)}, variant="human")
    (root / sr.PLAN).write_text('{"profile": "quick", "judge": "offline", "unavailable": '
                                '{"qwen2.5-coder-1.5b-instruct": "not fetched yet"}}\n')


def test_report_is_deterministic_and_complete(tmp_path):
    root = tmp_path / "runs"
    make_root(root)
    args = ["--report-only", "--quick", "--root", str(root), "--report-dir", str(tmp_path / "rep"),
            "--figures-dir", str(tmp_path / "fig")]
    assert main(args) == 0
    first = (tmp_path / "rep" / "README.md").read_text()
    assert main(args) == 0
    assert (tmp_path / "rep" / "README.md").read_text() == first
    for k in ("accuracy", "temperature", "perturbations", "profiles", "human"):
        assert (tmp_path / "fig" / f"study_{k}.png").stat().st_size > 1000
        assert f"](../fig/study_{k}.png)" in first
    assert "`offline-test`" in first  # the judge that made the labels is named
    assert "qwen2.5-coder-1.5b-instruct skipped**: not fetched yet" in first
    assert first.count("*Per model") == 1 and "## 6. Claims" in first
    # numbers come from the runs: smollm2's T=1 rate is 6/12 = 50%, qwen's 12/12 = 100%
    assert "| smollm2-135m-instruct | gsm8k | 6 | 50.0% [" in first
    assert "| 50.0% [" in first and "| 100.0% [" in first
    assert "answers at cap" in first and "16.7% [" in first  # 1 of 6 answers hit the cap
    assert "12 s" in first  # stage time summed from study_stages.jsonl
    assert "process CPU time (all threads), recorded for later commands only: not recorded" in first


def test_aggregates_from_synthetic_runs(tmp_path):
    root = tmp_path / "runs"
    make_root(root)
    data = sr.collect(root, "labels_offline.jsonl", include_truncated=True)  # every synthetic turn counts here
    a = sr.aggregate_model(data, "qwen2.5-coder-0.5b-instruct")
    assert a.greedy == Rate(0, 12)
    assert a.lift[0] == pytest.approx(1.0)  # greedy 0/12 items genuine, every sample genuine
    (swap,) = a.paired
    assert swap.variant == "swap" and swap.sampled_full == Rate(24, 24) and swap.sampled_variant == Rate(0, 24)
    assert swap.b == swap.c == 0 and swap.p_mcnemar == 1.0
    assert swap.diff == pytest.approx(-1.0) and swap.p_boot == 0.0
    assert a.tvd is not None and a.other_family == ["smollm2-135m-instruct"]
    assert a.n_lift_items == 12 and swap.n_items == 12
    assert sr.decide_move(a.paired).verdict == "held"
    assert sr.decide_lift(a.lift, a.n_lift_items).verdict == "held"


def test_decision_rules_on_synthetic_aggregates():
    assert sr.decide_greedy_zero(Rate(0, 100)).verdict == "held"
    assert sr.decide_greedy_zero(Rate(40, 100)).verdict == "refuted"
    assert sr.decide_greedy_zero(Rate(0, 5)).verdict == "inconclusive"  # Wilson upper bound 43%
    assert sr.decide_greedy_zero(Rate(0, 0)) == Verdict("inconclusive", "no judged greedy turns")
    assert sr.decide_lift((0.2, 0.1, 0.3, 0.0), 20).verdict == "held"
    assert sr.decide_lift((0.0, -0.01, 0.01, 1.0), 20).verdict == "refuted"
    assert sr.decide_lift((0.0, 0.0, 0.0, 1.0), 3).verdict == "inconclusive"  # 3 items: degenerate bootstrap
    assert sr.decide_lift((0.05, -0.02, 0.12, 0.3), 20).verdict == "inconclusive"
    nan = float("nan")
    assert sr.decide_lift((nan, nan, nan, nan), 0).verdict == "inconclusive"

    def pr(p_mc, diff, lo, hi, p_boot, n=10):
        return sr.PairedResult("swap", Rate(0, n), Rate(0, n), 0, 0, p_mc, Rate(5, 20), Rate(5, 20), diff,
                               (lo, hi), p_boot, n)

    assert sr.decide_move([pr(0.001, 0.0, -0.01, 0.01, 0.9)]).verdict == "held"  # McNemar below 0.05/2
    assert sr.decide_move([pr(0.04, 0.0, -0.01, 0.01, 0.9)]).verdict == "refuted"  # 0.04 > 0.025; CI inside ±5
    assert sr.decide_move([pr(0.5, 0.1, -0.1, 0.3, 0.2)]).verdict == "inconclusive"
    assert sr.decide_move([pr(1.0, -0.5, -0.5, -0.5, 0.0, n=4)]).verdict == "inconclusive"  # bootstrap on 4 items
    assert sr.decide_move([pr(1.0, 0.0, 0.0, 0.0, 1.0, n=4)]).verdict == "inconclusive"
    assert sr.decide_move([]).verdict == "inconclusive"
    assert sr.decide_decoupled((0.01, -0.05, 0.06), 10, 10).verdict == "held"
    assert sr.decide_decoupled((0.3, 0.1, 0.5), 10, 10).verdict == "refuted"
    assert sr.decide_decoupled((0.0, -0.3, 0.3), 10, 10).verdict == "inconclusive"
    assert sr.decide_decoupled((0.01, -0.05, 0.06), 2, 10).verdict == "inconclusive"  # too few correct items
    assert sr.decide_family((0.4, 0.2, 0.6), ["q"]).verdict == "held"
    assert sr.decide_family((0.04, 0.01, 0.08), ["q"]).verdict == "refuted"
    assert sr.decide_family(None, []).verdict == "inconclusive"


def test_lift_is_paired_over_items():
    # 10 items: greedy 0/1 each, samples 1/2 each -> lift exactly +50 points, and the CI is degenerate at it
    d, lo, hi, p = paired_bootstrap([0] * 10, [1] * 10, [1] * 10, [2] * 10, n_boot=200)
    assert (d, lo, hi, p) == (pytest.approx(0.5), pytest.approx(0.5), pytest.approx(0.5), 0.0)


def test_unfetched_model_is_skipped_with_a_line_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setenv("MECHPROBE_CACHE", str(tmp_path / "empty-cache"))
    sc = StudyConfig(models=["qwen2.5-coder-1.5b-instruct"], datasets=["gsm8k"], profile="quick",
                     root=str(tmp_path / "runs"), report_dir=str(tmp_path / "rep"), figures_dir=str(tmp_path / "fig"),
                     progress=False)
    from mechprobe.study.run import StudyFailed

    with pytest.raises(StudyFailed, match="every model failed"):  # exit 2, not 0: nothing ran
        run_study(sc)
    text = (tmp_path / "rep" / "README.md").read_text()
    assert "**qwen2.5-coder-1.5b-instruct skipped**" in text and "models fetch" in text
    assert "No runs yet" in text


def test_variant_samples_profile_and_legacy_roots(tmp_path):
    """The full profile samples each variant once (19 turns per item, was 24); a root made before this was
    recorded keeps its 2 samples per variant, so resuming it neither mixes plans nor regenerates."""
    import json

    from mechprobe.cli import study as study_cli
    from mechprobe.study import run as study
    from mechprobe.turns.pipeline import ProbeConfig

    cfg = ProbeConfig(model="m", dataset="builtin", temperatures=[0.0, 0.4, 0.7, 1.0, 1.3], samples=2)
    main_turns = len(study.decoding_plan(cfg.temperatures, cfg.samples))
    full = StudyConfig(models=["m"], datasets=["builtin"])
    assert len(full.variant_plan(cfg)) == 2
    assert main_turns + 5 * len(full.variant_plan(cfg)) == 19
    assert len(StudyConfig(profile="quick").variant_plan(cfg)) == 3
    assert len(StudyConfig(variant_samples=0).variant_plan(cfg)) == 1

    fresh = study_cli.config_from_args(study_cli.build_parser().parse_args(["--root", str(tmp_path / "new"), "--judge", "x"]))
    assert fresh.variant_k() == 1
    old = tmp_path / "old"
    old.mkdir()
    (old / "plan.json").write_text(json.dumps({"profile": "full", "judge": "x"}))
    legacy = study_cli.config_from_args(study_cli.build_parser().parse_args(["--root", str(old)]))
    assert legacy.variant_k() == 2
    forced = study_cli.config_from_args(study_cli.build_parser().parse_args(["--root", str(old), "--variant-samples", "1"]))
    assert forced.variant_k() == 1


def test_turns_after_truncated_answers_are_counted_and_left_out_unless_included(tmp_path):
    """Item 0 of every synthetic run has a truncated answer: by default its user turns leave every rate and the
    report says so; --include-truncated keeps them."""
    root = tmp_path / "runs"
    make_root(root)
    out = sr.collect(root, "labels_offline.jsonl")
    kept = sr.collect(root, "labels_offline.jsonl", include_truncated=True)
    m = "qwen2.5-coder-0.5b-instruct"
    assert sr.aggregate_model(out, m).greedy.n == sr.aggregate_model(kept, m).greedy.n - 2  # one item per dataset
    assert all(t.item_id.split("-")[-1] != "0000" for rd in out.full.values() for t in rd.turns)
    assert sum(rd.n_truncated_turns for rd in out.full.values()) > 0
    text = sr.build_report(out, {k: "" for k in ("accuracy", "temperature", "perturbations", "profiles", "human")})
    assert "answers truncated, excluded" in text
    text_in = sr.build_report(kept, {k: "" for k in ("accuracy", "temperature", "perturbations", "profiles", "human")})
    assert "answers truncated, included" in text_in
