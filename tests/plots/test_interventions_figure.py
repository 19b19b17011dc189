"""The intervention study's figure: drawn from a table.json alone; its title names model, n, labels and correction."""

from __future__ import annotations

import json

import pytest

from mechprobe.plots.interventions import plot_study_arms, study_figure_title
from tests.conftest import REPO

V2C = REPO / "reports" / "interventions" / "interventions-0.5b-v2c" / "table.json"


def _cell(k, n, lo, hi, diff=None):
    c = {"k": k, "n": n, "rate": k / n, "lo": lo, "hi": hi}
    if diff is not None:
        c["vs_base"] = {"diff": diff, "lo": diff - 0.05, "hi": diff + 0.05}
    return c


def test_figure_from_a_table_with_a_point_outside_its_interval(tmp_path):
    """Bars from intervals whose bound misses the point by rounding must not raise (extents are clipped)."""
    tab = {"arms": {"base": {r: _cell(1, 10, 0.1 + 1e-17, 0.4) for r in ("strict", "lenient")},
                    "steer": {r: _cell(3, 10, 0.1, 0.6, diff=0.2) for r in ("strict", "lenient")}}}
    title = study_figure_title("tiny-model", "plan x", 10)
    out = plot_study_arms(tab, ["base", "steer", "not_in_table"], tmp_path / "f.png", title)
    assert out.stat().st_size > 1000
    assert "tiny-model" in title and "n = 10" in title and "not corrected" in title and "no judge" in title


@pytest.mark.skipif(not V2C.is_file(), reason="the committed part-1 table is not in this checkout")
def test_the_committed_part1_table_draws(tmp_path):
    tab = json.loads(V2C.read_text(encoding="utf-8"))
    out = plot_study_arms(tab, ["base", "base_t1", "answer_removed", "steer_audited", "steer_random"],
                          tmp_path / "arms.png", study_figure_title("qwen2.5-coder-0.5b-instruct", "plan v2c", 120))
    assert out.is_file()
