"""``--limit 0`` means "no limit" on every command that has the flag (probe, judge, probes, study)."""

from __future__ import annotations

import pytest

from mechprobe.cli.main import main
from mechprobe.io import read_jsonl
from mechprobe.stages import resolve_run
from mechprobe.study.run import StudyConfig
from tests.judges.test_judge_stage import make_run


def test_judge_limit_0_judges_every_row(tmp_path):
    run = make_run(tmp_path)
    assert main(["judge", str(run), "--judge", "offline-lexical", "--limit", "0", "--no-progress"]) == 0
    assert len(read_jsonl(run / "labels.jsonl")) == 8


def test_judge_limit_n_still_caps(tmp_path):
    run = make_run(tmp_path)
    assert main(["judge", str(run), "--judge", "offline-lexical", "--limit", "3", "--no-progress"]) == 0
    assert len(read_jsonl(run / "labels.jsonl")) == 3


def test_probes_limit_0_is_every_item(tmp_path):
    """``probes --limit 0`` reached ProbeConfig as limit 0 and was refused ("limit must be >= 1")."""
    _, cfg = resolve_run(tmp_path / "r", "smollm2-135m-instruct", "builtin", limit=0)
    assert cfg.limit is None
    _, cfg = resolve_run(tmp_path / "r", "smollm2-135m-instruct", "builtin", limit=7)
    assert cfg.limit == 7


def test_study_limit_0_is_every_item():
    sc = StudyConfig(models=["smollm2-135m-instruct"], datasets=["gsm8k"], limit=0, judge="offline")
    sc.validate()
    assert sc.probe_config("smollm2-135m-instruct", "gsm8k").limit is None
    with pytest.raises(Exception, match="limit=-1: must be >= 0"):
        StudyConfig(models=["smollm2-135m-instruct"], datasets=["gsm8k"], limit=-1, judge="offline").validate()


@pytest.mark.parametrize("command", ["probe", "judge", "probes", "study"])
def test_help_says_what_0_means(command, capsys):
    from mechprobe.cli import study

    with pytest.raises(SystemExit):
        study.main(["--help"]) if command == "study" else main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "0 = no limit" in out, out[:2000]
