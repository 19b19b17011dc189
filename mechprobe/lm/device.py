"""Where and how fast a model runs: the device, the dtype for it, and the CPU threads to use."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from mechprobe.errors import UsageError


def _busy_cores(window: float = 0.25) -> float:
    """Cores busy *now*: the non-idle share of ``/proc/stat`` CPU time over ``window`` seconds, times the cores.

    Why not the load average: it is a 1-minute mean, so a job that just ended still counts as a busy core for
    a minute or more, and the next command started after it (the usual case in a script) got one thread of
    two (measured: 1.5B llama.cpp at 13 tokens/s instead of 25). Falls back to the load average where
    ``/proc/stat`` is missing (macOS).
    """
    def snap() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                vals = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
        return sum(vals[:8]), idle  # user..steal; guest time is already counted in user

    a = snap()
    if a is not None:
        time.sleep(window)
        b = snap()
        if b is not None and b[0] > a[0]:
            n_all = os.cpu_count() or 1
            return n_all * (1.0 - (b[1] - a[1]) / (b[0] - a[0]))
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def cpu_threads() -> int:
    """Threads for CPU work: ``$MECHPROBE_THREADS``, else the cores not busy right now (:func:`_busy_cores`).

    Why not always every core: torch's OpenMP and llama.cpp's threads wait for each other at every op, so
    on a shared CPU a second thread that keeps being descheduled stalls the first. Measured on a 2-core
    machine at load average ~12 (SmolLM2, batch 8): torch decoded 50 tokens/s with 1 thread, 9 with 2;
    llama.cpp 78-81 with 1, 2-15 with 2. On an idle machine this returns every core, as before.
    """
    if os.environ.get("MECHPROBE_THREADS"):
        return max(1, int(os.environ["MECHPROBE_THREADS"]))
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(n, int(n - _busy_cores() + 0.5)))


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_device(device: str | torch.device | None, field: str = "device") -> torch.device:
    """The device to use, refusing one this machine cannot run on before any weights load.

    Why: ``torch.device("nope")`` raises a RuntimeError listing every backend, and ``cuda`` on a machine
    without a GPU fails only after the model was loaded (an AssertionError from ``.to``).

    Raises:
        UsageError: an unknown device name, or an accelerator that is not available here.
    """
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise UsageError(f"{field}={device!r} is not a device: pass cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise UsageError(f"{field}={device}: no CUDA GPU is visible here; pass device=cpu")
        if dev.index is not None and dev.index >= n:
            raise UsageError(f"{field}={device}: only {n} CUDA GPU(s) visible (cuda:0..cuda:{n - 1})")
    elif dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise UsageError(f"{field}={device}: MPS is not available here; pass device=cpu")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"{field}={device}: mechprobe runs on cpu, cuda or mps")
    return dev


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (what users run at scale), fp32 on CPU (bf16 matmuls are slow and lossy there)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def cpu_has_native_bf16() -> bool:
    """True when this CPU has native bf16 matmuls (AVX512-BF16 or AMX); False where /proc/cpuinfo is unreadable."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def native_bf16_dtype() -> str | None:
    """``"bfloat16"`` when generation runs on a CPU with native bf16 matmuls (the study's default there), else None.

    Why: bf16 with automatic batches is 2-5x the fp32 path on such CPUs (benchmarks/README.md); on CPUs without
    it bf16 is emulated and slower, and on a GPU the model's own default (bf16) already applies.
    """
    if torch.cuda.is_available():
        return None
    return "bfloat16" if cpu_has_native_bf16() else None
