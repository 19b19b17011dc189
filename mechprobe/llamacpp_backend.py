"""Optional llama.cpp engine for the probe's generation stages on CPUs (``--engine llamacpp``).

Why: decoding on a CPU is memory-bound, and llama.cpp reads the GGUF's Q4 weights directly (~6x fewer
bytes per token than the dequantised fp32 copy transformers runs), so the assistant and user turns of a
0.5B-1.5B model are several times faster. Caching, probes and steering stay on the hookable HF path.

Same contract as :func:`mechprobe.generation.generate` and the vLLM engine: token-id prompts in,
:class:`~mechprobe.generation.Generation` out. Which guarantees hold, exactly:

* prompt token ids are the HF tokenizer's (we pass ids to ``llama_decode``; llama.cpp's own tokenizer is
  never used), so special tokens in the prompt are the template's and no second BOS appears;
* generated ids are returned raw (special tokens included; text is decoded later by the HF tokenizer);
* generation stops at the template's end-of-turn / EOS ids from :func:`mechprobe.chat.stop_token_ids`,
  with the same stop reasons, and the stop token is kept like the HF engine keeps it;
* each sampled row is seeded alone (llama.cpp's ``dist`` sampler, seed = the row seed mod 2**32), so a
  row is reproducible and independent of its batch; rows run one at a time;
* greedy is argmax over llama.cpp's logits. These are *not* bit-equal to the HF engine's: llama.cpp
  multiplies Q4 weights with activations quantised to 8 bits, HF multiplies the dequantised weights in
  fp32. Greedy continuations agree with HF for the first tokens and may diverge later at near-ties;
  samples are not token-identical to the HF engine's (different RNG). The run's identity (GGUF sha256,
  tokenizer and template hashes) equals the HF path's, so ``mechprobe cache`` reads its turns with the HF
  model and re-encodes nothing: the cached prompt ids are the same ids.

Consecutive rows that share a prompt prefix (the greedy row and the k samples of one item, sorted next to
each other by the pipeline) reuse llama.cpp's KV cache for that prefix instead of prefilling it again.

Install: ``pip install llama-cpp-python==0.3.36`` (a source build: several minutes of compile, ~22 min
under heavy CPU contention; not part of ``scripts/setup.sh``). On CPUs with AMX that a VM does not grant,
the native build segfaults in decode: :func:`smoke_check` turns that into an error naming :data:`REBUILD`.
"""

from __future__ import annotations

import atexit
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from .errors import UserError
from .generation import Generation
from .io import sha256_file
from .models import cpu_threads

INSTALL = "pip install llama-cpp-python==0.3.36"
# A build that crashes in decode on CPUs whose AMX tiles the (virtual) machine does not grant: rebuild without AMX.
REBUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON '
           '-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" '
           'pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36')

_SMOKE = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, n_batch=16, verbose=False)
for _ in llm.generate([int(sys.argv[2])] * 4, temp=0.0, reset=True):
    break
print("ok")
"""


class LlamaCppBroken(UserError, RuntimeError):
    """The installed llama-cpp-python crashes when it decodes (e.g. an AMX build on a VM without AMX)."""


def smoke_check(gguf: str | Path, token_id: int = 1, timeout: float = 300.0) -> None:
    """Decode a few tokens in a child process; raise :class:`LlamaCppBroken` if it dies.

    Why a child: a llama.cpp build compiled for CPU features that the machine reports but does not grant
    (AMX tiles inside some VMs) segfaults inside ``llama_decode``, which would kill the whole probe run
    (or test session) with no Python error. The verdict is remembered per (library file, GGUF) in the
    mechprobe cache, so the check costs a few seconds once.
    """
    import hashlib
    import subprocess
    import sys

    import llama_cpp  # type: ignore[import-not-found]

    from .models import cache_dir

    lib = Path(llama_cpp.__file__).parent
    libs = sorted(str(p) + str(p.stat().st_size) + str(p.stat().st_mtime_ns) for p in lib.rglob("*.so*"))
    key = hashlib.sha256(("\n".join(libs) + str(gguf)).encode()).hexdigest()[:16]
    mark = cache_dir() / "llamacpp_ok" / key
    if mark.exists():
        return
    r = subprocess.run([sys.executable, "-c", _SMOKE, str(gguf), str(token_id)], capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0 or "ok" not in r.stdout:
        how = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
        raise LlamaCppBroken(f"llama-cpp-python crashes when decoding on this machine ({how}); a build with AMX "
                             f"enabled does this on VMs that do not grant AMX tiles. Rebuild without AMX: {REBUILD} "
                             "(or use --engine hf)")
    mark.parent.mkdir(parents=True, exist_ok=True)
    mark.write_text("ok\n")


def resolve_gguf(model: str) -> tuple[Path, str, str]:
    """(GGUF path, model name as the HF path records it, weight hash) for an embedded name or a .gguf path.

    The name and hash are exactly what :func:`mechprobe.models.load_model` records, so a run probed with
    this engine is cached later by the HF path without an identity mismatch.
    """
    from .models import EMBEDDED, embedded_gguf_path

    if model in EMBEDDED:
        return embedded_gguf_path(model), EMBEDDED[model].name, EMBEDDED[model].sha256
    if str(model).endswith(".gguf"):
        p = Path(model).expanduser()
        if not p.exists():
            raise UserError(f"GGUF file {p} does not exist: pass an existing .gguf path or an embedded model name")
        return p, str(p), sha256_file(p)
    raise UserError(f"--engine llamacpp needs a GGUF model (an embedded name or a .gguf file), got {model!r}: "
                    "use --engine hf for Hugging Face ids and directories")


def load_tokenizer(gguf: Path, weight_hash: str, snapshot_name: str) -> tuple[Any, Any]:
    """The HF tokenizer and generation config of a GGUF, without loading its weights.

    Read from the converted snapshot when one exists (what the HF path loads), else from the GGUF, so the
    tokenizer hash and the EOS ids match the HF path's.
    """
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from .models import snapshot_dir

    snap = snapshot_dir(snapshot_name, weight_hash)
    if (snap / "mechprobe_snapshot.json").exists():
        tok = AutoTokenizer.from_pretrained(snap)
        try:
            gen_cfg = GenerationConfig.from_pretrained(snap)
        except OSError:
            gen_cfg = GenerationConfig.from_model_config(AutoConfig.from_pretrained(snap))
    else:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        gen_cfg = GenerationConfig.from_model_config(AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok, gen_cfg


def load_llamacpp(gguf: str | Path, *, n_ctx: int = 4096, n_threads: int | None = None, **kwargs: Any) -> Any:
    """A ``llama_cpp.Llama`` over ``gguf``; a clear error naming the install command when it is missing."""
    try:
        import llama_cpp  # type: ignore[import-not-found]
    except ImportError as e:
        raise UserError(f"the llamacpp engine needs llama-cpp-python: run `{INSTALL}` (a source build, several "
                        "minutes), or use --engine hf") from e
    smoke_check(gguf)
    threads = n_threads or cpu_threads()
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, verbose=False, **kwargs)
    # Free it before interpreter teardown: llama_cpp's __del__ at exit calls into an unloaded library.
    atexit.register(llm.close)
    return llm


class LlamaCppEngine:
    """The probe's decode function over one ``llama_cpp.Llama`` (rows run one after another)."""

    def __init__(self, llm: Any):
        self.llm = llm

    def decode_batch(self, prompts: Sequence[Sequence[int]], **kw: Any) -> list[Generation]:
        kw.pop("pad_id", None)
        return generate_llamacpp(self.llm, prompts, **kw)


def load_engine(model: str, chat_template: str | None = None, n_ctx: int = 4096,
                n_threads: int | None = None) -> tuple[Any, LlamaCppEngine]:
    """(LoadedModel with tokenizer and no weights, engine) for ``--engine llamacpp``."""
    from .models import EMBEDDED, LoadedModel

    gguf, name, weight_hash = resolve_gguf(model)
    snapshot_name = EMBEDDED[model].name if model in EMBEDDED else gguf.stem
    tok, gen_cfg = load_tokenizer(gguf, weight_hash, snapshot_name)
    if chat_template:
        p = Path(chat_template)
        tok.chat_template = p.read_text() if p.exists() else chat_template
    engine = LlamaCppEngine(load_llamacpp(gguf, n_ctx=n_ctx, n_threads=n_threads))
    # A weightless stand-in: chat.stop_token_ids reads the EOS ids from model.generation_config.
    stub = SimpleNamespace(generation_config=gen_cfg)
    lm = LoadedModel(model=stub, tokenizer=tok, name=name, weight_hash=weight_hash, device=torch.device("cpu"),
                     dtype=torch.float32)
    return lm, engine


def generate_llamacpp(
    llm: Any,
    prompts: Sequence[Sequence[int]],
    *,
    stop_ids: dict[int, str],
    max_new_tokens: int = 128,
    temperatures: float | Sequence[float] = 0.0,
    seeds: Sequence[int | None] | None = None,
    top_p: float = 1.0,
) -> list[Generation]:
    """Decode token-id prompts one by one; temperature 0 is greedy, > 0 samples with the row's seed.

    The sampler chain is temperature + ``dist`` only (top-k, min-p, typical and penalties disabled), i.e.
    plain sampling from softmax(logits / T), like the HF engine with ``top_p=1``.
    """
    n = len(prompts)
    temps = [float(temperatures)] * n if isinstance(temperatures, int | float) else [float(t) for t in temperatures]
    if len(temps) != n:
        raise ValueError("one temperature per prompt")
    seeds = list(seeds) if seeds is not None else [None] * n
    if any(t > 0 and s is None for t, s in zip(temps, seeds)):
        raise ValueError("sampled rows need a seed so they can be regenerated exactly")
    n_ctx = llm.n_ctx()
    out: list[Generation] = []
    for p, t, s in zip(prompts, temps, seeds):
        p = [int(x) for x in p]
        if not p:
            raise ValueError("empty prompt")
        if len(p) + max_new_tokens > n_ctx:
            raise UserError(f"prompt ({len(p)} tokens) + max new tokens ({max_new_tokens}) exceed the llama.cpp "
                            f"context of {n_ctx}: load the engine with a larger n_ctx or lower the token caps")
        llm.set_seed(int(s) % (1 << 32) if s is not None else 0)
        toks: list[int] = []
        reason = "max_tokens"
        # top_k=0 / min_p=0 / typical_p=1 / top_p=1 disable those samplers; temp 0 selects the greedy sampler.
        for tid in llm.generate(p, top_k=0, top_p=top_p, min_p=0.0, typical_p=1.0, temp=t, repeat_penalty=1.0,
                                reset=True):
            toks.append(int(tid))
            if tid in stop_ids:
                reason = stop_ids[int(tid)]
                break
            if len(toks) >= max_new_tokens:
                break
        out.append(Generation(token_ids=toks, stop_reason=reason))
    return out
