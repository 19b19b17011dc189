"""The hybrid-voice judge's voice minimum: chosen on dev halves of the two 1.5B hand-label fixtures, scored once on test.

    python benchmarks/choose_voice.py [--out benchmarks/results/voice_choice.json]

Dev = ``hand_labels_q15_*`` split ``dev`` + the steered fixture's items at even positions (sorted ids); test = the
rest. Hybrid v1 labels (grounding PMI, cache off) and the voice margin of every turn, then a grid of minimums scored
by mean binary κ against the two labellers on dev. Prints the table in docs/judge_agreement.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
FIX = HERE.parent / "tests" / "fixtures"
G = "genuine_followup"
GRID = [None, -0.1, -0.05, 0.0, 0.05, 0.1, 0.15, 0.2, 0.3]


def _jsonl(p: Path) -> list[dict]:
    return [json.loads(x) for x in p.read_text(encoding="utf-8").splitlines() if x.strip()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--out", default=str(HERE / "results" / "voice_choice.json"))
    a = p.parse_args()

    import torch
    from tqdm.auto import tqdm

    from mechprobe.judges.agreement import cohen_kappa
    from mechprobe.judges.base import JudgeInput
    from mechprobe.judges.hybrid import HybridJudge, voice_scores
    from mechprobe.judges.offline import split_roles
    from mechprobe.lm.device import cpu_threads

    torch.set_num_threads(cpu_threads())
    d_lab = {r["record_id"]: r["label"] for r in _jsonl(FIX / "hand_labels_q15_d.jsonl")}
    rows = [("q15", r, (r["label"], d_lab[r["record_id"]]), r["split"]) for r in _jsonl(FIX / "hand_labels_q15_c.jsonl")]
    steer = _jsonl(FIX / "hand_labels_steer_q15.jsonl")
    items = sorted({r["item_id"] for r in steer})
    half = {it: "dev" if k % 2 == 0 else "test" for k, it in enumerate(items)}
    rows += [("steer", r, (r["label_e"], r["label_f"]), half[r["item_id"]]) for r in steer]
    j = HybridJudge(a.model, cache_dir=False)
    inputs = [JudgeInput(record_id=r["record_id"], prompt=r["prompt"], response=r["response"], raw_text=r["raw_text"])
              for _, r, _, _ in rows]
    v1 = {x.record_id: x.label for x in j.label_many(inputs)}
    out = []
    for (st, r, refs, split), inp in tqdm(list(zip(rows, inputs)), desc="voice", unit="turn"):
        text = split_roles(inp.raw_text)[0].text
        v = voice_scores(j.store, j.lm.tokenizer, inp, [text])[0] if text.strip() else None
        for slot in ("real", "assistant"):
            j.store.forget(slot)
        out.append({"set": st, "split": split, "record_id": r["record_id"], "refs": refs, "v1": v1[inp.record_id],
                    "voice": v, "condition": r.get("condition")})

    def lab(r: dict, t: float | None) -> str:
        demote = r["v1"] == G and t is not None and r["voice"] is not None and r["voice"] < t
        return "assistant_continuation" if demote else r["v1"]

    def kap(rs: list[dict], t: float | None, k: int) -> float:
        return cohen_kappa([lab(r, t) == G for r in rs], [r["refs"][k] == G for r in rs])

    dev = [r for r in out if r["split"] == "dev"]
    grid = {str(t): (kap(dev, t, 0) + kap(dev, t, 1)) / 2 for t in GRID}
    best = max(GRID, key=lambda t: grid[str(t)])
    print("dev mean binary kappa:", {k: round(v, 3) for k, v in grid.items()}, "-> chosen", best)
    test = {}
    for st in ("q15", "steer"):
        t_rows = [r for r in out if r["split"] == "test" and r["set"] == st]
        for t in (None, best):
            test[f"{st}@{t}"] = {"n": len(t_rows), "kappa_ref0": kap(t_rows, t, 0), "kappa_ref1": kap(t_rows, t, 1),
                                 "called_genuine": sum(lab(r, t) == G for r in t_rows),
                                 "ref0_genuine": sum(r["refs"][0] == G for r in t_rows)}
            print(f"test {st} minimum={t}: {json.dumps({k: round(v, 3) for k, v in test[f'{st}@{t}'].items()})}")
    Path(a.out).write_text(json.dumps({"dev_grid": grid, "chosen": best, "test": test, "rows": out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
