"""scripts/answer_cap.py picks the smallest cap that at most the target share of answers reach."""

import json
import subprocess
import sys

from tests.conftest import REPO


def _run(tmp_path, lengths, cap=1024):
    run = tmp_path / "run"
    run.mkdir()
    (run / "manifest.json").write_text(json.dumps({"config": {"model": "m", "dataset": "gsm8k",
                                                              "max_assistant_tokens": cap}}))
    rows = [{"item_id": str(i), "n_tokens": n, "stop_reason": "max_tokens" if n >= cap else "end_of_turn"}
            for i, n in enumerate(lengths)]
    (run / "assistant.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_cap_is_the_smallest_that_few_answers_reach(tmp_path):
    # 100 answers: 90 of 200 tokens, 6 of 300, 3 of 500, one that hit the 1024 cap (counts as longer than any cap)
    run = _run(tmp_path, [200] * 90 + [300] * 6 + [500] * 3 + [1024])
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "answer_cap.py"), str(run)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "**320**" in r.stdout  # 256 is reached by 10%, 320 by 4% (the 500-token answers and the loop)
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "answer_cap.py"), str(run), "--target", "0.005"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "none below 1024" in r.stdout  # the looping answer reaches every cap
