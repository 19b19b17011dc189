"""The probe's progress bars tell the truth while the run is still going: a long run's cost is estimated from
them, and the answers bar showed 1 of 80 items while 64 answers were already written (tqdm throttles redraws and
the user-turn stage of the batch ran before the next update)."""

from __future__ import annotations

import re

from mechprobe.turns import pipeline
from mechprobe.turns.pipeline import ProbeConfig, run_probe
from tests.conftest import requires_smollm2


@requires_smollm2
def test_the_answers_bar_shows_every_written_answer_before_their_user_turns(smol, tmp_path, monkeypatch, capsys):
    shown: list[tuple[int, int]] = []
    real = pipeline._TurnsAfterAnswers.__call__

    def spy(self, ids):
        err = capsys.readouterr().err
        bars = re.findall(r"assistant turns:.*?(\d+)/(\d+)", err)
        shown.append((int(bars[-1][0]), len(ids)))
        return real(self, ids)
    monkeypatch.setattr(pipeline._TurnsAfterAnswers, "__call__", spy)
    cfg = ProbeConfig(model="smollm2-135m-instruct", dataset="builtin", limit=4, temperatures=[0.0], samples=0,
                      max_assistant_tokens=8, max_user_tokens=4, batch_size=2)
    run_probe(cfg, tmp_path / "run", lm=smol, progress=True)
    assert [s for s, _ in shown] == [2, 4]  # each batch's answers counted before its user turns start
