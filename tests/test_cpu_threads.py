"""Thread choice on shared CPUs: use the idle cores (threads that spin-wait on busy cores stall each other)."""

from __future__ import annotations

import os

import pytest
import torch

from mechprobe.models import cpu_threads


def test_cpu_threads_leaves_busy_cores_alone(monkeypatch):
    monkeypatch.delenv("MECHPROBE_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (12.0, 12.0, 12.0))
    assert cpu_threads() == 1  # never 0: one thread even when every core is busy
    monkeypatch.setattr(os, "getloadavg", lambda: (0.3, 0.2, 0.1))
    assert cpu_threads() == 2  # idle machine: every core, as before
    monkeypatch.setattr(os, "getloadavg", lambda: (1.2, 1.0, 1.0))
    assert cpu_threads() == 1
    monkeypatch.setenv("MECHPROBE_THREADS", "3")
    assert cpu_threads() == 3  # an explicit choice wins


@pytest.mark.slow
def test_load_model_applies_the_thread_choice_on_cpu(smol, monkeypatch):
    from mechprobe.models import load_model

    before = torch.get_num_threads()
    monkeypatch.setenv("MECHPROBE_THREADS", "1")
    try:
        torch.set_num_threads(2)
        load_model("smollm2-135m-instruct", device="cpu", dtype="bfloat16")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
