"""experiments/relabel_steering.py: re-judges a steering directory's turns without generating (offline judge)."""

from __future__ import annotations

import json


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_relabel_counts_pairs_and_excludes(tmp_path):
    from mechprobe.cli.relabel_steering import main

    run = tmp_path / "run"
    q = "Tom has 3 apples and buys 4 more. How many apples does he have?"
    a = "Tom has 3 + 4 = 7 apples."
    _write(run / "assistant.jsonl", [{"item_id": f"i{k}", "prompt": q, "response": a, "dataset": "gsm8k"}
                                     for k in range(4)])
    empty = {"raw_text": "<|im_end|>", "text": "", "stop_reason": "end_of_turn"}
    _write(run / "steering" / "alpha_0_none.jsonl", [{"item_id": f"i{k}", **empty} for k in range(4)])
    _write(run / "steering" / "L3" / "alpha_1_diff_means.jsonl",
           [{"item_id": f"i{k}", **empty} for k in range(2)]
           + [{"item_id": f"i{k}", "raw_text": "Thanks!", "text": "Thanks!", "stop_reason": "end_of_turn"}
              for k in (2, 3)])
    _write(run / "steering" / "select" / "alpha_0_none.jsonl", [{"item_id": "i0", **empty}])  # train items: skipped
    assert main(["--run", str(run), "--judge", "offline-lexical"]) == 0
    res = json.loads((run / "steering" / "relabel_offline_lexical.json").read_text())
    rows = {r["condition"]: r for r in res["rows"]}
    assert set(rows) == {"alpha_0_none", "L3/alpha_1_diff_means"}
    assert rows["alpha_0_none"]["counts"] == {"empty_or_degenerate": 4} and rows["alpha_0_none"]["paired"] is None
    steered = rows["L3/alpha_1_diff_means"]
    assert steered["n"] == 4 and steered["counts"]["empty_or_degenerate"] == 2
    assert steered["paired"]["n_paired"] == 4 and steered["paired"]["c"] == 0
    (tmp_path / "skip.txt").write_text("i0\ni1\n")
    assert main(["--run", str(run), "--judge", "offline-lexical", "--exclude-items", str(tmp_path / "skip.txt")]) == 0
    res = json.loads((run / "steering" / "relabel_offline_lexical.json").read_text())
    assert res["excluded"] == ["i0", "i1"] and all(r["n"] == 2 for r in res["rows"])
    assert (run / "steering" / "relabel_offline_lexical.md").read_text().startswith("# Steering re-judged")
