"""How fast a judge labels turns on this machine, and the CPU every timing names.

Why a module of its own: ``judges evaluate --speed`` times several judges on the same turns, one after another in
one process, and every speed row must say which CPU it ran on; the timing must also bypass verdict caches, or it
measures the cache.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mechprobe.judges.base import JudgeInput
from mechprobe.judges.factory import make_judge

__all__ = ["cpu_description", "uncached_judge", "measure_speed", "speed_sample", "answers_in", "time_turns"]


def cpu_description() -> str:
    """The CPU's model name and the cores this process may use (for every speed row: a time names its CPU)."""
    name = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
        name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), name)
        flags = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
        extra = [f for f in ("amx_bf16", "avx512_bf16") if f" {f}" in flags]
        name += f" ({'/'.join(extra)})" if extra else ""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return f"{name}, {cores} cores"


def uncached_judge(spec: str) -> Any:
    """The judge ``spec`` names without its verdict cache: a timed turn the cache already holds costs nothing,
    so a timing with the cache on measures the cache (an LLM judge read 7.5 turns/s from it on turns judged before)."""
    return make_judge(spec, cache_dir=False)


def measure_speed(specs: Sequence[str], inputs: Sequence[JudgeInput],
                  make: Callable[[str], Any] = uncached_judge, cpu: str = "", note: str = "") -> list[dict[str, Any]]:
    """Turns per second of each judge spec on the same ``inputs`` (one after another, in this process).

    Args:
        specs: judge specs to time.
        inputs: the turns; the first warms each judge up (lazy loads) and is not timed.
        make: builds a judge from a spec (default: without its verdict cache).
        cpu: the CPU the rows name (default: :func:`cpu_description`).
        note: a free-text note copied into every row (the load, what ran beside).
    Returns:
        One row per spec: judge, name (the judge's own name: a hidden judge's names its weights version), turns,
        seconds, turns_per_s, cpu, note.
    """
    cpu = cpu or cpu_description()
    rows = []
    warm, timed = list(inputs[:1]), list(inputs[1:])
    for spec in specs:
        judge = make(spec)
        list(judge.label_many(warm))  # loads what the judge loads lazily (the encoder, the LM's prefix cache)
        t0 = time.perf_counter()
        n = sum(1 for _ in judge.label_many(timed))
        dt = time.perf_counter() - t0
        rows.append({"judge": spec, "name": getattr(judge, "name", spec), "turns": n, "seconds": round(dt, 2), "turns_per_s": round(n / dt, 3),
                     "cpu": cpu, "note": note})
    return rows



def speed_sample(candidates: Sequence[JudgeInput], n: int, whole_answers: bool = False) -> list[JudgeInput]:
    """The turns a timing reads: one warm-up turn, then ``n`` timed turns.

    Why two shapes: a reader judge computes the shared conversation (question, query, answer) once per answer and
    only the turn itself per turn, so its cost per turn depends on how many turns share an answer. ``whole_answers``
    False times the worst case, one turn per answer (the first turn of each answer, in order); True times turns as
    a run holds them, every turn of an answer together (greedy, samples, a study's arms), whole answers until ``n``
    timed turns are reached. The warm-up turn comes from an answer the timed turns do not hold.

    Args:
        candidates: the turns to draw from, in a fixed order.
        n: timed turns wanted (whole answers may give a few more).
        whole_answers: see above.
    Returns:
        ``[warm-up, *timed]`` (fewer when the candidates run out).

    Example:
        >>> ts = [JudgeInput(f"r{i}", "q", f"a{i // 2}", "t") for i in range(8)]
        >>> [t.record_id for t in speed_sample(ts, 2)], [t.record_id for t in speed_sample(ts, 3, True)]
        (['r0', 'r2', 'r4'], ['r0', 'r2', 'r3', 'r4', 'r5'])
    """
    groups: dict[tuple[str, str], list[JudgeInput]] = {}
    for c in candidates:
        groups.setdefault((c.prompt, c.response), []).append(c)
    answers = list(groups.values())
    if not answers:
        return []
    out = [answers[0][0]]
    for g in answers[1:]:
        if len(out) > n:
            break
        out += g[:len(g) if whole_answers else 1]
    return out


def answers_in(turns: Sequence[JudgeInput]) -> int:
    """How many distinct answers (query, answer pairs) ``turns`` hold (a timing's note says it)."""
    return len({(t.prompt, t.response) for t in turns})


def time_turns(specs: Sequence[str], candidates: Sequence[JudgeInput], n: int, whole_answers: bool = False,
               where: str = "turns") -> list[dict[str, Any]]:
    """:func:`measure_speed` of ``specs`` on :func:`speed_sample` of ``candidates``, each row's note saying what was
    timed (``where``, turns, answers and their shape) and the load at the start.

    Example:
        >>> rows = time_turns(["textfit"], turns, 40, whole_answers=True, where="turns of judge_fresh_test_v5")  # doctest: +SKIP
    """
    sample = speed_sample(candidates, n, whole_answers)
    shape = "every turn of each" if whole_answers else "one turn each"
    return measure_speed(specs, sample, note=f"{len(sample) - 1} {where} ({answers_in(sample[1:])} answers, {shape}) "
                                             f"after 1 warm-up; load average {os.getloadavg()[0]:.1f} at start")
