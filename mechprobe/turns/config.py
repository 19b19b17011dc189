"""The probe's configuration: everything that determines a probe run's outputs (and goes into its manifest)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mechprobe.errors import UserError
from mechprobe.lm.registry import DEFAULT_MODEL

__all__ = ["ENGINES", "ProbeConfig", "default_run_dir"]

ENGINES = ("hf", "vllm", "llamacpp")


@dataclass
class ProbeConfig:
    """Everything that determines a probe run's outputs (and goes into its manifest).

    :meth:`identity` (all fields but ``limit``, ``batch_size``, ``device``, ``data_path``) must match to
    extend an existing run; :meth:`validate` refuses bad values before anything is loaded.

    Args:
        model: model to probe (embedded name, HF directory, ``.gguf`` or hub id); default the embedded
            SmolLM2-135M-Instruct.
        dataset: dataset name (:func:`~mechprobe.turns.datasets.load_dataset`); default ``"builtin"``.
        data_path: local file or folder for the dataset; None (default) = the usual search.
        limit: first this many items (>= 1); None = all; default 50.
        temperatures: user-turn decodings; 0 = one greedy turn, each ``T > 0`` = ``samples`` sampled turns
            (default ``[0.0, 1.0]``).
        samples: sampled turns per temperature > 0 (default 3).
        max_assistant_tokens: token cap of the assistant answer (default 256; capped answers are marked
            ``max_tokens`` and left out of headline rates).
        max_user_tokens: token cap of the generated user turn (default 64).
        seed: base seed; each sampled row's seed is derived from it and the record id (default 0).
        system: system prompt; None (default) keeps the chat template's default.
        chat_template: Jinja template string or file replacing the tokenizer's; None (default) = its own.
        batch_size: rows per decode call; None (default) = automatic (fits half the free memory, <= 64).
        device: ``"cpu"``/``"cuda"``; None (default) = CUDA when visible.
        dtype: model dtype name; None (default) = bf16 on CUDA, fp32 on CPU.
        engine: ``"hf"`` (default: exact and hookable), ``"vllm"`` (GPU) or ``"llamacpp"`` (CPU, GGUF).

    Example:
        >>> from mechprobe import ProbeConfig
        >>> cfg = ProbeConfig(dataset="gsm8k", limit=10, temperatures=[0.0])
        >>> cfg.validate()
        >>> "limit" in cfg.identity(), cfg.identity()["dataset"]
        (False, 'gsm8k')
        >>> ProbeConfig(temperatures=[-1.0]).validate()
        Traceback (most recent call last):
        ...
        mechprobe.errors.UserError: invalid probe configuration: temperature -1.0 must be a finite number >= 0 (0 = greedy)
    """

    model: str = DEFAULT_MODEL
    dataset: str = "builtin"
    data_path: str | None = None
    limit: int | None = 50
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    samples: int = 3
    max_assistant_tokens: int = 256
    max_user_tokens: int = 64
    seed: int = 0
    system: str | None = None
    chat_template: str | None = None
    batch_size: int | None = None  # None = auto: as many rows as fit in half the free memory (<= 64)
    device: str | None = None
    dtype: str | None = None
    engine: str = "hf"  # "hf" (exact, hookable) | "vllm" (GPU sampling) | "llamacpp" (CPU, GGUF weights)

    def identity(self) -> dict[str, Any]:
        """What must match to extend an existing run (limit, batch size and device may change)."""
        d = asdict(self)
        for k in ("limit", "batch_size", "device", "data_path"):
            d.pop(k)
        return d

    def validate(self) -> None:
        """Refuse values that would run but give wrong or empty data (NaN temperatures, negative counts).

        Called before anything is loaded or written; one :class:`UserError` lists every problem.
        """
        bad: list[str] = []
        temps = list(self.temperatures or [])
        if not temps:
            bad.append("no temperatures: pass temperatures=0 (greedy) and/or values > 0")
        for t in temps:
            if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
                bad.append(f"temperature {t!r} must be a finite number >= 0 (0 = greedy)")
        finite_t = [float(t) for t in temps if isinstance(t, int | float) and math.isfinite(t)]
        dup = sorted({t for t in finite_t if finite_t.count(t) > 1})
        if dup:
            bad.append(f"temperature(s) {dup} given more than once")
        if not isinstance(self.samples, int) or self.samples < 0:
            bad.append(f"samples must be an integer >= 0, got {self.samples!r}")
        elif self.samples == 0 and any(t > 0 for t in finite_t):
            bad.append("samples is 0 but a temperature > 0 was given: pass samples= >= 1, or temperatures=0 "
                       "for greedy only")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            bad.append(f"limit must be >= 1 (or None for every row; 0 on the command line), got {self.limit!r}")
        for name in ("max_assistant_tokens", "max_user_tokens", "batch_size"):
            v = getattr(self, name)
            if name == "batch_size" and v is None:
                continue
            if not isinstance(v, int) or v < 1:
                bad.append(f"{name} must be an integer >= 1, got {v!r}")
        if self.engine not in ENGINES:
            bad.append(f"unknown engine {self.engine!r}: use {', '.join(ENGINES)}")
        if bad:
            raise UserError("invalid probe configuration: " + "; ".join(bad))


def default_run_dir(cfg: ProbeConfig) -> Path:
    """``runs/<model>-<dataset>``: where ``mechprobe probe`` writes when no run directory is given."""
    model = Path(cfg.model).name.replace(".gguf", "")
    return Path("runs") / f"{model}-{cfg.dataset}"
