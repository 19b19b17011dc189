"""`mechprobe judges fit`: the trained judge's weights are fit by a command of the package, not only by a script.

A small synthetic labelled-turn set checks the command end to end (weights that load, the report, one-line
errors); the real set checks that the command reproduces the package's committed weights and fit report.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest

from mechprobe.cli.main import main as cli_main
from mechprobe.judges.fit_trained import FIT_COMMAND, LabelledTurns, fit_trained_judge
from mechprobe.judges.trained import load_weights
from mechprobe.judges.turn_features import FEATURE_NAMES
from mechprobe.taxonomy import GENUINE
from tests.conftest import REPO

REAL_SET = REPO / "reports" / "labelled_turns"


def _synthetic_set(root, n_items: int = 30, seed: int = 0):
    """Two subject models, three turns an item; the features carry the label (with noise)."""
    rng = random.Random(seed)
    turns, a_rows, b_rows, adj_rows, feats = [], [], [], [], []
    for i in range(n_items):
        for j in range(3):
            tid = f"t{i:03d}{j}"
            genuine = rng.random() < 0.4
            label = GENUINE if genuine else "new_query"
            turns.append({"turn_id": tid, "model": f"m{i % 2}", "dataset": "gsm8k", "item_id": f"q{i}",
                          "item_key": f"k{i}", "split": "dev" if i < n_items - 4 else "test", "condition": "greedy",
                          "query": f"q{i}", "answer": f"a{i}", "turn": f"turn {tid}"})
            a_rows.append({"row": tid, "label": label})
            other = label if rng.random() < 0.9 else ("new_query" if genuine else GENUINE)
            b_rows.append({"row": tid, "label": other})
            if other != label:
                adj_rows.append({"row": tid, "label": label})
            f = {name: rng.gauss(0, 1) for name in FEATURE_NAMES}
            f[FEATURE_NAMES[0]] += 2.0 if genuine else 0.0
            feats.append({"turn_id": tid, "features": f, "offline": label if rng.random() < 0.7 else "new_query"})
    (root / "labels").mkdir(parents=True)
    (root / "turns.jsonl").write_text("".join(json.dumps(t) + "\n" for t in turns), encoding="utf-8")
    (root / "features.jsonl").write_text("".join(json.dumps(f) + "\n" for f in feats), encoding="utf-8")
    for name, rows in (("labeller-a", a_rows), ("labeller-b", b_rows), ("adjudicated", adj_rows)):
        (root / "labels" / f"{name}.json").write_text(json.dumps({"rows": rows}), encoding="utf-8")
    return root


def test_judges_fit_command_writes_weights_that_load(tmp_path, capsys):
    s = _synthetic_set(tmp_path / "set")
    w = tmp_path / "w.json"
    assert cli_main(["judges", "fit", str(s), "--weights", str(w)]) == 0
    out = capsys.readouterr().out
    assert "# Trained judge: fit on the dev split" in out and str(w) in out
    weights = load_weights(w)  # format, finite numbers and the recorded digest all check
    assert weights["fit"]["script"] == FIT_COMMAND and weights["features"] == list(FEATURE_NAMES)
    assert weights["fit"]["dev_items"] == 26 and (s / "fit.md").read_text(encoding="utf-8") in out


def test_judges_fit_refuses_a_directory_without_turns_in_one_line(tmp_path, capsys):
    assert cli_main(["judges", "fit", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert "turns.jsonl" in err and "\n" not in err


def test_judges_fit_without_features_names_the_features_step(tmp_path, capsys):
    s = _synthetic_set(tmp_path / "set")
    (s / "features.jsonl").unlink()
    assert cli_main(["judges", "fit", str(s), "--weights", str(tmp_path / "w.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "mechprobe judges features" in err and "\n" not in err
    assert not (tmp_path / "w.json").exists()


@pytest.mark.slow
def test_fit_on_the_real_set_reproduces_the_package_weights(tmp_path):
    """The command is the fit that made ``mechprobe/data/trained_judge.json``: same C, threshold and
    coefficients (to float noise), same fit report."""
    s = tmp_path / "labelled_turns"
    s.mkdir()
    for name in ("turns.jsonl", "features.jsonl", "judges.jsonl", "labels"):
        src = REAL_SET / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, s / name)
    fit = fit_trained_judge(LabelledTurns(s), tmp_path / "w.json")
    committed = json.loads((REPO / "mechprobe" / "data" / "trained_judge.json").read_text(encoding="utf-8"))
    assert (fit.weights["C"], fit.weights["threshold"]) == (committed["C"], committed["threshold"])
    for key in ("coef", "mean", "scale"):
        assert fit.weights[key] == pytest.approx(committed[key], rel=1e-9, abs=1e-12)
    assert fit.weights["intercept"] == pytest.approx(committed["intercept"], rel=1e-9)
    assert fit.report == (REAL_SET / "fit.md").read_text(encoding="utf-8")
