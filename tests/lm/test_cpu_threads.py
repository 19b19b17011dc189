"""Thread choice on shared CPUs: use the idle cores (threads that spin-wait on busy cores stall each other)."""

from __future__ import annotations

import os

import pytest
import torch

from mechprobe.lm.device import cpu_threads


def test_cpu_threads_leaves_busy_cores_alone(monkeypatch):
    from mechprobe.lm import device

    monkeypatch.delenv("MECHPROBE_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(device, "_busy_cores", lambda: 12.0)
    assert cpu_threads() == 1  # never 0: one thread even when every core is busy
    monkeypatch.setattr(device, "_busy_cores", lambda: 0.3)
    assert cpu_threads() == 2  # idle machine: every core, as before
    monkeypatch.setattr(device, "_busy_cores", lambda: 1.2)
    assert cpu_threads() == 1
    monkeypatch.setenv("MECHPROBE_THREADS", "3")
    assert cpu_threads() == 3  # an explicit choice wins


@pytest.mark.slow
def test_load_model_applies_the_thread_choice_on_cpu(smol, monkeypatch):
    from mechprobe.lm.models import load_model

    before = torch.get_num_threads()
    monkeypatch.setenv("MECHPROBE_THREADS", "1")
    try:
        torch.set_num_threads(2)
        load_model("smollm2-135m-instruct", device="cpu", dtype="bfloat16")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_busy_cores_sees_a_spinning_process_now_not_a_minute_ago():
    """A process spinning during the window counts as about one busy core (the load average would lag)."""
    import subprocess
    import sys

    from mechprobe.lm.device import _busy_cores

    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 5: pass"])
    try:
        busy = _busy_cores(window=1.0)
    finally:
        spin.kill()
        spin.wait()
    assert 0.5 <= busy <= (os.cpu_count() or 1) + 0.01, busy


def test_busy_cores_falls_back_to_the_load_average(monkeypatch):
    import builtins

    from mechprobe.lm.device import _busy_cores

    real_open = builtins.open

    def no_proc(path, *a, **k):
        if str(path) == "/proc/stat":
            raise OSError("no /proc here")
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", no_proc)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    assert _busy_cores() == 1.5
