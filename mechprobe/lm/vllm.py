"""Optional vLLM engine for the sampling stage (the bulk of generation at temperature > 0).

Same contract as :func:`mechprobe.lm.generation.generate`: token-id prompts in, :class:`Generation` out, one
seed per row (vLLM's per-request ``SamplingParams(seed=...)``), stop at the template's end-of-turn ids with
the same stop reasons. Use it for the probe stage on GPUs when thousands of samples are needed:

    python experiments/probe.py --model Qwen/Qwen2.5-7B-Instruct --engine vllm ...

Limits, stated plainly: vLLM is not installable on the CPU machines mechprobe is developed on, so this
module is tested against a stand-in with vLLM's documented interface (``tests/lm/test_vllm_backend.py``),
not against vLLM itself. vLLM's sampler differs from torch's ``multinomial``: rows are reproducible
with vLLM for a fixed seed, but not token-identical to the HF engine. Activations, steering and greedy
decoding stay on the HF engine, where hooks are exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mechprobe.lm.generation import Generation


def load_vllm(model: str, **kwargs: Any) -> Any:
    """A ``vllm.LLM`` for ``model`` (HF id or directory); a clear error when vLLM is missing."""
    try:
        import vllm  # type: ignore[import-not-found]  # lazy: optional GPU engine
    except ImportError as e:
        raise ImportError("the vllm engine needs vLLM on a CUDA machine: pip install vllm") from e
    return vllm.LLM(model=model, **kwargs)


def generate_vllm(
    llm: Any,
    prompts: Sequence[Sequence[int]],
    *,
    stop_ids: dict[int, str],
    max_new_tokens: int = 128,
    temperatures: float | Sequence[float] = 1.0,
    seeds: Sequence[int | None] | None = None,
) -> list[Generation]:
    """Decode token-id prompts with vLLM; output order matches ``prompts``."""
    from vllm import SamplingParams  # type: ignore[import-not-found]  # lazy: optional GPU engine

    n = len(prompts)
    temps = [float(temperatures)] * n if isinstance(temperatures, int | float) else list(temperatures)
    seeds = list(seeds) if seeds is not None else [None] * n
    params = [SamplingParams(temperature=t, seed=s, max_tokens=max_new_tokens, stop_token_ids=sorted(stop_ids),
                             skip_special_tokens=False) for t, s in zip(temps, seeds)]
    inputs = [{"prompt_token_ids": list(p)} for p in prompts]
    outs = llm.generate(inputs, sampling_params=params, use_tqdm=False)
    result: list[Generation] = []
    for o in outs:
        c = o.outputs[0]
        ids = list(c.token_ids)
        if c.finish_reason == "stop" and isinstance(c.stop_reason, int):
            # vLLM leaves a stop token out of token_ids; keep it, like the HF engine does.
            if not ids or ids[-1] != c.stop_reason:
                ids.append(c.stop_reason)
            reason = stop_ids.get(c.stop_reason, "end_of_turn")
        elif c.finish_reason == "stop" and ids and ids[-1] in stop_ids:
            reason = stop_ids[ids[-1]]
        else:
            reason = "max_tokens"
        result.append(Generation(token_ids=ids, stop_reason=reason))
    return result
