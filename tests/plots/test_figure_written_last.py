"""A figure is the last thing a command writes, and a plotting failure ends in one line naming it.

Why: ``steer`` computed for seven minutes, wrote results.json and results.md, then ended in a matplotlib
traceback and exit 1 over a 1e-17 error bar. The drivers now draw through :func:`draw_figure` after every result
file: the files stay, the command's last line names the figure and the error, and the exit code says it failed.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from mechprobe.linear import experiment as linear_experiment
from mechprobe.steering import experiment as steer_experiment


def _broken(*args, **kwargs):
    raise ValueError("'yerr' must not contain negative values")


def _steer(tmp_path):
    a = SimpleNamespace(figures=str(tmp_path / "figs"), positions="boundary+generated", include_truncated=False,
                        no_assistant_check=True)
    s = SimpleNamespace(a=a, out_dir=tmp_path / "steering", split=None, unit="resid", run=tmp_path / "run",
                        items=SimpleNamespace(heldout=[], by_item={}), judge=SimpleNamespace(name="offline"),
                        scorer=SimpleNamespace(dtype="float32"), cfg=SimpleNamespace(model="smollm2-135m-instruct"))
    s.out_dir.mkdir()
    raw = SimpleNamespace(resid_norm=1.0, describe=lambda: "diff of means")
    rows = [dict(kind="diff_means", alpha=al, followup_rate=0.0, ci=[1.39e-17, 0.228], degenerate_rate=0.0,
                 degenerate_ci=[0.0, 0.228]) for al in (0.0, 0.05)]
    return s, dict(layer=9, alphas=[0.0, 0.05], raw=raw, v=SimpleNamespace(meta={}), rows=rows, sweep=[],
                   selection=None, n_acc=0, audit=None, frozen="0" * 64, t0=time.time())


def _fake_tables(monkeypatch):
    monkeypatch.setattr(steer_experiment, "results_header", lambda **kw: "header")
    monkeypatch.setattr(steer_experiment, "results_md", lambda rows, header, unit, audited: "| table |\n")


def test_steer_draws_its_figure_after_the_results(tmp_path, monkeypatch):
    _fake_tables(monkeypatch)
    s, kw = _steer(tmp_path)
    res = steer_experiment._write_results(s, **kw)
    assert res.exit_code == 0 and res.figure == tmp_path / "figs" / "steer_run.png" and res.figure.is_file()
    fig_time = res.figure.stat().st_mtime_ns
    assert all((s.out_dir / f).stat().st_mtime_ns <= fig_time for f in ("results.json", "results.md"))


def test_a_failed_steering_figure_is_one_last_line_after_every_result_file(tmp_path, monkeypatch):
    _fake_tables(monkeypatch)
    monkeypatch.setattr(steer_experiment, "plot_steering", _broken)
    s, kw = _steer(tmp_path)
    res = steer_experiment._write_results(s, **kw)
    assert json.loads((s.out_dir / "results.json").read_text())["layer"] == 9
    assert (s.out_dir / "results.md").is_file()
    assert res.exit_code == 1 and res.figure is None
    last = res.summary().splitlines()[-1]
    assert last.startswith(f"mechprobe: error: figure not drawn: {tmp_path / 'figs' / 'steer_run.png'} (ValueError")
    assert "'yerr' must not contain negative values" in last and "Traceback" not in res.summary()
    assert "results.md and results.json" in res.summary()


def test_a_failed_no_curve_figure_keeps_the_metrics_and_ends_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(linear_experiment, "plot_no_curve", _broken)
    fig = tmp_path / "figs" / "linear_probe_run.png"
    res = linear_experiment._no_fit(tmp_path, fig, {"run": str(tmp_path / "run")}, {"genuine rows": 0},
                                    "no positive rows", "title", time.time())
    assert json.loads((tmp_path / "metrics.json").read_text())["status"] == "insufficient_positives"
    assert (tmp_path / "metrics.md").is_file() and res.exit_code == 3 and res.figure is None
    assert res.message.splitlines()[-1].startswith(f"mechprobe: error: figure not drawn: {fig} (ValueError")
