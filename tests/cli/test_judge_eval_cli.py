"""``mechprobe judge-eval``: bad input is one line and exit 2."""

from __future__ import annotations

from mechprobe.cli.main import main


def test_no_labelled_sets_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "reports").mkdir()
    assert main(["judge-eval", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no blind-labelled turns" in err and "--root" in err


def test_negative_n_boot_is_refused(tmp_path, capsys):
    assert main(["judge-eval", "--root", str(tmp_path), "--n-boot", "0"]) == 2
    assert "--n-boot" in capsys.readouterr().err


def test_judges_evaluate_is_the_same_command(tmp_path):
    """``judges evaluate`` and ``judge-eval`` parse the same flags and refuse the same bad input."""
    assert main(["judges", "evaluate", "--root", str(tmp_path)]) == 2
    assert main(["judges", "evaluate", "--root", str(tmp_path), "--n-boot", "0"]) == 2
