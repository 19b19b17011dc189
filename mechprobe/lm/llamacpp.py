"""Optional llama.cpp engine for the probe's generation stages on CPUs (``--engine llamacpp``).

Why: decoding on a CPU is memory-bound, and llama.cpp reads the GGUF's Q4 weights directly (~6x fewer
bytes per token than the dequantised fp32 copy transformers runs), so the assistant and user turns of a
0.5B-1.5B model are several times faster. Caching, probes and steering stay on the hookable HF path.

Same contract as :func:`mechprobe.lm.generation.generate` and the vLLM engine: token-id prompts in,
:class:`~mechprobe.lm.generation.Generation` out. Which guarantees hold, exactly:

* prompt token ids are the HF tokenizer's (we pass ids to ``llama_decode``; llama.cpp's own tokenizer is
  never used), so special tokens in the prompt are the template's and no second BOS appears;
* generated ids are returned raw (special tokens included; text is decoded later by the HF tokenizer);
* generation stops at the template's end-of-turn / EOS ids from :func:`mechprobe.lm.chat.stop_token_ids`,
  with the same stop reasons, and the stop token is kept like the HF engine keeps it;
* each sampled row is seeded alone (numpy generator seeded with the row seed; plain softmax(logits / T)),
  so a row is reproducible from its seed whatever rows share its batch;
* up to ``max_rows`` rows (default 32) decode together in one llama.cpp context, one KV stream per row;
  rows with an identical prompt (greedy + the k samples of an item) prefill it once and copy its cells.
  Batched == alone: a row's logits were bit-identical whatever else was in its batch on this build (a
  lone row is padded to two, because ggml uses another kernel for one-row batches, see ``_decode``).
  This is how ggml's CPU kernels behave, not an arithmetic guarantee, so the test allows a greedy flip
  only where the row alone had its top two logits within 0.05 (it found none). Not on every CPU: on a 2-core
  AMD EPYC (AVX2) half of 8 greedy 1.5B answers changed with their batch (docs/gotchas.md);
* greedy is argmax over llama.cpp's logits. These are *not* bit-equal to the HF engine's: llama.cpp
  multiplies Q4 weights with activations quantised to 8 bits, HF multiplies the dequantised weights in
  fp32. Greedy continuations agree with HF for the first tokens and may diverge later at near-ties;
  samples are not token-identical to the HF engine's (different RNG). The run's identity (GGUF sha256,
  tokenizer and template hashes) equals the HF path's, so ``mechprobe cache`` reads its turns with the HF
  model and re-encodes nothing: the cached prompt ids are the same ids.

Runs made before the multi-row engine (0.3.36 ``dist`` sampler, one row at a time) sampled with another
RNG; resuming such a run mixes two exact samplers of the same distribution (the records keep their seeds).

Install: ``pip install llama-cpp-python==0.3.36`` (a source build: several minutes of compile, ~22 min
under heavy CPU contention; not part of ``scripts/setup.sh``). On CPUs with AMX that a VM does not grant,
the native build segfaults in decode: :func:`smoke_check` turns that into an error naming :data:`REBUILD`.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from mechprobe.errors import UserError
from mechprobe.io import sha256_file
from mechprobe.lm.device import cpu_threads
from mechprobe.lm.generation import Generation
from mechprobe.lm.models import LoadedModel, prepare_tokenizer, tokenizer_source
from mechprobe.lm.registry import EMBEDDED, cache_dir, embedded_gguf_path

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
    import llama_cpp  # type: ignore[import-not-found]  # lazy: extra [llamacpp]

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
                             "(or use engine=hf)")
    mark.parent.mkdir(parents=True, exist_ok=True)
    mark.write_text("ok\n")


def resolve_gguf(model: str) -> tuple[Path, str, str]:
    """(GGUF path, model name as the HF path records it, weight hash) for an embedded name or a .gguf path.

    The name and hash are exactly what :func:`mechprobe.lm.models.load_model` records, so a run probed with
    this engine is cached later by the HF path without an identity mismatch.
    """

    if model in EMBEDDED:
        return embedded_gguf_path(model), EMBEDDED[model].name, EMBEDDED[model].sha256
    if str(model).endswith(".gguf"):
        p = Path(model).expanduser()
        if not p.exists():
            raise UserError(f"GGUF file {p} does not exist: pass an existing .gguf path or an embedded model name")
        return p, str(p), sha256_file(p)
    raise UserError(f"engine=llamacpp needs a GGUF model (an embedded name or a .gguf file), got {model!r}: "
                    "use engine=hf for Hugging Face ids and directories")


def generation_config(gguf: Path, weight_hash: str, snapshot_name: str) -> Any:
    """The HF generation config of a GGUF (its EOS ids), without loading its weights, from where
    :func:`~mechprobe.lm.models.tokenizer_source` reads the tokenizer."""
    from transformers import AutoConfig, GenerationConfig  # lazy: slow import

    src, kw = tokenizer_source(gguf, weight_hash, snapshot_name)
    if not kw:  # the converted snapshot
        try:
            return GenerationConfig.from_pretrained(src)
        except OSError:
            return GenerationConfig.from_model_config(AutoConfig.from_pretrained(src))
    return GenerationConfig.from_model_config(AutoConfig.from_pretrained(src, **kw))


def load_llamacpp(gguf: str | Path, *, n_ctx: int = 4096, n_threads: int | None = None, **kwargs: Any) -> Any:
    """A ``llama_cpp.Llama`` over ``gguf``; a clear error naming the install command when it is missing."""
    try:
        import llama_cpp  # type: ignore[import-not-found]  # lazy: extra [llamacpp]
    except ImportError as e:
        raise UserError(f"the llamacpp engine needs llama-cpp-python: run `{INSTALL}` (a source build, several "
                        "minutes), or use engine=hf") from e
    smoke_check(gguf)
    threads = n_threads or cpu_threads()
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, verbose=False, **kwargs)
    # Free it before interpreter teardown: llama_cpp's __del__ at exit calls into an unloaded library.
    atexit.register(llm.close)
    return llm


class PrefixCache:
    """Saved KV states of prompts already prefilled, keyed by their token ids (least recently used evicted).

    Why: prefill is the slow part of llama.cpp on this CPU (1.5B Q4_K_M, 2 threads: ~110 prompt tokens/s
    against ~70 generated tokens/s over 32 rows), and steering prefills the same prompts again for every
    condition (alpha 0, each vector kind and alpha, the task-accuracy check). After a prefill the
    sequence's cells are saved with ``llama_state_seq_get_data`` (~28 KB per token on the 1.5B model); the
    same prompt later restores them instead of being prefilled again.

    Only whole prompts are reused, never a prefix + the rest: restoring cells is exact (the very same
    bytes), but a remainder decoded on its own runs through other ggml kernels than the one-chunk prefill
    of the whole prompt (measured: a 1-token remainder changed a greedy turn on the 135M model), so a
    prompt's logits would depend on what the process had prefilled before. States are saved and used only
    with no control vector set.
    """

    def __init__(self, max_bytes: int = 2 << 30, min_tokens: int = 16):
        self.max_bytes, self.min_tokens = int(max_bytes), int(min_tokens)
        self.entries: OrderedDict[tuple[int, ...], tuple[bytes, np.ndarray]] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = 0
        self.context: tuple[int, int] | None = None  # (max_rows, row_ctx) of the context the states came from

    def get(self, prompt: Sequence[int]) -> tuple[bytes, np.ndarray] | None:
        """(state, logits after the last token) saved for exactly ``prompt``, or None."""
        key = tuple(prompt)
        hit = self.entries.get(key)
        if hit is not None:
            self.entries.move_to_end(key)
        return hit

    def put(self, key: tuple[int, ...], state: bytes, logits: np.ndarray) -> None:
        if len(key) < self.min_tokens or len(state) > self.max_bytes:
            return
        old = self.entries.pop(key, None)
        if old is not None:
            self.nbytes -= len(old[0])
        self.entries[key] = (state, logits)
        self.nbytes += len(state)
        while self.nbytes > self.max_bytes and self.entries:
            _, (st, _) = self.entries.popitem(last=False)
            self.nbytes -= len(st)

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0


class LlamaCppEngine:
    """The probe's decode function over one GGUF: up to ``max_rows`` rows decoded together.

    Why rows together: one decode step of a 0.5B-1.5B model on a CPU reads all the weights once whatever the
    number of rows, so 32 rows cost ~8 single-row steps here (measured: 1.5B, 2 threads, 13 -> 58 tokens/s).
    Rows with an identical prompt (the greedy row and the k samples of one item) prefill it once and share
    its KV cells (``llama_memory_seq_cp``).
    """

    def __init__(self, llm: Any, max_rows: int = 32, n_ctx: int | None = None, cache_mb: int | None = 2048):
        self.llm = llm
        self.max_rows = max_rows
        # Saved prompt states (None: off). Kept by the engine, so a rebuilt multi-row context still has them.
        self.cache: PrefixCache | None = PrefixCache(cache_mb << 20) if cache_mb else None
        # The longest prompt + new tokens one row may hold (default: the model's training context).
        self.n_ctx = int(n_ctx or llm._model.n_ctx_train())
        self._ms: _MultiSeq | None = None
        self.fed: list[list[int]] = []  # the token ids put into each sequence by the last call (tests read it)
        self.margins: list[list[float]] = []
        self.record_margins = False

    def multi(self, need: int = 512) -> _MultiSeq:
        """The multi-row context, rebuilt larger when a row needs more than ``need`` KV cells."""
        if self._ms is None or self._ms.row_ctx < need:
            if self._ms is not None:
                self._ms.close()
            row_ctx = max(512, 1 << (max(need, 1) - 1).bit_length())
            self._ms = _MultiSeq(self.llm, self.max_rows, row_ctx)
            if self.cache is not None and self.cache.context != (self.max_rows, row_ctx):
                # llama.cpp restores a saved state only into a context of the same shape (measured: a state
                # from a 2-sequence context is refused by a 4-sequence one), so states of another shape go.
                self.cache.clear()
                self.cache.context = (self.max_rows, row_ctx)
        self._ms.cache = self.cache
        return self._ms

    def close(self) -> None:
        if self._ms is not None:
            self._ms.close()
            self._ms = None

    def decode_batch(self, prompts: Sequence[Sequence[int]], **kw: Any) -> list[Generation]:
        kw.pop("pad_id", None)
        return generate_llamacpp(self, prompts, **kw)


class _MultiSeq:
    """A second llama.cpp context over the same loaded weights with ``max_rows`` sequences of ``row_ctx`` cells.

    ``llama_cpp.Llama`` runs one sequence; the low-level API decodes a batch whose tokens each name their
    sequence. Each sequence gets its own KV stream (``kv_unified=False``): a row then computes the same
    logits bit for bit wherever its cells are and whatever else is in the batch (measured: with one shared
    buffer, a prompt prefilled after another one gave logits up to 0.5 apart, because tiny differences in
    summation order flip the 8-bit activation rounding of the quantised matmuls), and it was also faster
    here (1.5B, 32 rows: 28 vs 21 tokens/s) since no row attends over other rows' masked cells.
    """

    def __init__(self, llm: Any, max_rows: int, row_ctx: int):
        import llama_cpp as L  # type: ignore[import-not-found]  # lazy: extra [llamacpp]

        self.L = L
        model = llm._model.model
        self.n_vocab = int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(model)))
        self.n_embd = int(L.llama_model_n_embd(model))
        self.n_layer = int(L.llama_model_n_layer(model))
        self._cvec: np.ndarray | None = None
        # Start from the Llama object's own parameters (not llama.cpp's defaults, which turn flash attention
        # on where supported and change the logits), and change only the size and the number of sequences.
        cp = type(llm.context_params).from_buffer_copy(llm.context_params)
        n_ctx = row_ctx * (max_rows + 1)
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, 512, 512
        cp.n_seq_max, cp.kv_unified = max_rows + 1, False  # + a scratch sequence, see _decode
        self.ctx = L.llama_init_from_model(model, cp)
        if not self.ctx:
            raise UserError(f"llama.cpp could not create a context of {n_ctx} cells for {max_rows} rows: "
                            "lower the engine's max_rows (memory) or the token caps")
        self.row_ctx, self.max_rows, self.n_batch = row_ctx, max_rows, 512
        self.mem = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(512, 0, 1)
        self.scratch = max_rows
        # seq -> (prompt, logits after it) for prompts whose cells a sequence still holds (reused by the next group)
        self.prompts: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}
        self.n_prefills = 0
        self.cache: PrefixCache | None = None
        self._llm = llm  # keeps the weights alive as long as this context
        atexit.register(self.close)

    def close(self) -> None:
        if self.ctx is not None:
            self.L.llama_batch_free(self.batch)
            self.L.llama_free(self.ctx)
            self.ctx = None

    def clear(self) -> None:
        self.L.llama_memory_clear(self.mem, True)
        self.prompts = {}

    def _decode(self, toks: list[tuple[int, int, int, bool]]) -> None:
        """Decode (token, position, sequence, want logits) entries in one llama_decode call.

        A lone token is decoded beside a copy of itself in a scratch sequence (dropped afterwards): ggml
        multiplies a one-row batch with another kernel than a multi-row one, and its logits differ by up to
        ~1 (measured on the 135M model's Q4_1 weights), while every multi-row batch gave a row the same
        logits bit for bit whatever else was in it. Two rows minimum makes a row's tokens depend on its seed
        and prompt only, not on how many other rows were still running.
        """
        pad = len(toks) == 1
        if pad:
            t, pos, _, _ = toks[0]
            toks = [toks[0], (t, pos, self.scratch, False)]
        b = self.batch
        for i, (t, pos, seq, lg) in enumerate(toks):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos, 1, lg
            b.seq_id[i][0] = seq
        b.n_tokens = len(toks)
        rc = self.L.llama_decode(self.ctx, b)
        if pad:
            self.L.llama_memory_seq_rm(self.mem, self.scratch, -1, -1)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} (1 = no KV slot: the rows do not fit the context)")

    def logits(self, i: int) -> np.ndarray:
        ptr = self.L.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def prefill(self, prompt: list[int], seq: int) -> np.ndarray:
        """Decode ``prompt`` into ``seq`` (an empty sequence) in n_batch chunks; the logits after its last token.

        With a :class:`PrefixCache` and no control vector, a prompt prefilled before is restored instead
        (same cells, same logits); a new one is prefilled and its state saved for the next caller.
        """
        self.n_prefills += 1
        cache = self.cache if self._cvec is None else None
        if cache is not None:
            hit = cache.get(prompt)
            if hit is not None and self.restore(hit[0], seq):
                cache.hits += 1
                return hit[1].copy()
            cache.misses += 1  # (a refused restore left the sequence empty: prefill from scratch)
        last = None
        for st in range(0, len(prompt), self.n_batch):
            chunk = prompt[st:st + self.n_batch]
            self._decode([(t, st + i, seq, st + i == len(prompt) - 1) for i, t in enumerate(chunk)])
            last = len(chunk) - 1
        assert last is not None
        logits = self.logits(last)
        if cache is not None:
            cache.put(tuple(prompt), self.save(seq), logits.copy())
        return logits

    def save(self, seq: int) -> bytes:
        """The cells of ``seq`` as bytes (``llama_state_seq_get_data``)."""
        L = self.L
        n = int(L.llama_state_seq_get_size(self.ctx, seq))
        buf = (ctypes.c_uint8 * n)()
        got = int(L.llama_state_seq_get_data(self.ctx, buf, n, seq))
        if got != n:
            raise RuntimeError(f"llama_state_seq_get_data wrote {got} of {n} bytes")
        return bytes(buf)

    def restore(self, state: bytes, seq: int) -> bool:
        """Put saved cells into ``seq`` (emptied first); False (and ``seq`` empty) when llama.cpp refuses them."""
        L = self.L
        L.llama_memory_seq_rm(self.mem, seq, -1, -1)
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if int(L.llama_state_seq_set_data(self.ctx, buf, len(state), seq)) == 0:
            L.llama_memory_seq_rm(self.mem, seq, -1, -1)
            return False
        return True

    def set_cvec(self, vec: np.ndarray | None, resid_index: int = 0) -> None:
        """Add ``vec`` to the residual stream at ``resid_index`` for every token decoded from now on (None: off).

        llama.cpp's control vector for layer ``il`` is added to the *output* of block ``il`` (0-based), and
        block 0 has none, so residual index r (our convention: r = output of block r - 1, as in
        :mod:`mechprobe.steering.vector`) maps to ``il = r - 1`` and only ``2 <= r <= n_layer`` can be steered here.
        """
        L = self.L
        if vec is None:
            L.llama_set_adapter_cvec(self.ctx, None, 0, self.n_embd, 0, 0)
            self._cvec = None
            return
        il = resid_index - 1
        if not 1 <= il <= self.n_layer - 1:
            raise UserError(f"the llama.cpp engine can steer residual indices 2..{self.n_layer}, not {resid_index}: "
                            "choose another layer or steer with engine=hf")
        v = np.asarray(vec, dtype=np.float32).reshape(-1)
        if v.size != self.n_embd:
            raise UserError(f"steering vector has {v.size} dims, the model {self.n_embd}: built for another model?")
        buf = np.zeros((self.n_layer - 1) * self.n_embd, dtype=np.float32)  # data starts at block 1
        buf[(il - 1) * self.n_embd: il * self.n_embd] = v
        self._cvec = buf  # llama.cpp copies it, but keep it alive until the call returns anyway
        rc = L.llama_set_adapter_cvec(self.ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), buf.size,
                                      self.n_embd, il, il)
        if rc != 0:
            raise RuntimeError(f"llama_set_adapter_cvec returned {rc}")

    def copy_seq(self, src: int, dst: int) -> None:
        self.L.llama_memory_seq_cp(self.mem, src, dst, -1, -1)


def _pick(logits: np.ndarray, temp: float, top_p: float, rng: np.random.Generator | None) -> int:
    """Argmax at temperature 0; else one draw from softmax(logits / T) (nucleus-cut when top_p < 1)."""
    if temp <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temp
    z -= z.max()
    p = np.exp(z)
    if top_p < 1.0:
        order = np.argsort(-p)
        c = np.cumsum(p[order]) / p.sum()
        keep = order[: int(np.searchsorted(c, top_p)) + 1]
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q
    cdf = np.cumsum(p)
    assert rng is not None
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(p) - 1))


def load_engine(model: str, chat_template: str | None = None, n_ctx: int = 16384,
                n_threads: int | None = None, max_rows: int = 32) -> tuple[Any, LlamaCppEngine]:
    """(LoadedModel with tokenizer and no weights, engine) for ``--engine llamacpp``."""
    from transformers import AutoTokenizer  # lazy: slow import

    gguf, name, weight_hash = resolve_gguf(model)
    snapshot_name = EMBEDDED[model].name if model in EMBEDDED else gguf.stem
    src, kw = tokenizer_source(gguf, weight_hash, snapshot_name)
    tok = prepare_tokenizer(AutoTokenizer.from_pretrained(src, **kw), chat_template or None)
    gen_cfg = generation_config(gguf, weight_hash, snapshot_name)
    # The Llama object only holds the weights (its own one-sequence context stays tiny); rows decode in a
    # second context with n_ctx KV cells shared by up to max_rows sequences.
    engine = LlamaCppEngine(load_llamacpp(gguf, n_ctx=256, n_threads=n_threads), max_rows=max_rows, n_ctx=n_ctx)
    # A weightless stand-in: chat.stop_token_ids reads the EOS ids from model.generation_config.
    stub = SimpleNamespace(generation_config=gen_cfg)
    lm = LoadedModel(model=stub, tokenizer=tok, name=name, weight_hash=weight_hash, device=torch.device("cpu"),
                     dtype=torch.float32)
    return lm, engine


def generate_llamacpp(
    engine: LlamaCppEngine,
    prompts: Sequence[Sequence[int]],
    *,
    stop_ids: dict[int, str],
    max_new_tokens: int = 128,
    temperatures: float | Sequence[float] = 0.0,
    seeds: Sequence[int | None] | None = None,
    top_p: float = 1.0,
    steer: tuple[Any, int, str] | None = None,
) -> list[Generation]:
    """Decode token-id prompts, up to ``engine.max_rows`` at a time; temperature 0 is greedy.

    ``steer = (vector already times alpha, residual index, positions)`` adds the vector with llama.cpp's
    control-vector mechanism at the positions :mod:`mechprobe.steering.vector` names: ``all`` (prompt too),
    ``boundary+generated`` (the prompt's last token, i.e. the user header's, and every generated token),
    ``generated`` or ``boundary``. For the boundary alone to be steered the prompt is prefilled without its
    last token, which is then decoded on its own; a steered call never reuses another call's KV cells.

    Sampling is plain softmax(logits / T) (nucleus-cut when ``top_p < 1``), drawn in numpy from a generator
    seeded with the row's seed alone, so a row's tokens do not depend on which rows share its batch (see
    :class:`_MultiSeq`). Rows are grouped in the given order (the pipeline sorts the rows of one item next
    to each other) so identical prompts land in one group and are prefilled once.
    """
    n = len(prompts)
    temps = [float(temperatures)] * n if isinstance(temperatures, int | float) else [float(t) for t in temperatures]
    if len(temps) != n:
        raise ValueError("one temperature per prompt")
    seeds = list(seeds) if seeds is not None else [None] * n
    if any(t > 0 and s is None for t, s in zip(temps, seeds)):
        raise ValueError("sampled rows need a seed so they can be regenerated exactly")
    if steer is not None and steer[2] not in ("all", "boundary", "generated", "boundary+generated"):
        raise UserError(f"positions={steer[2]!r}: use all, boundary, generated or boundary+generated")
    if steer is not None:
        v = steer[0].detach().cpu().float().numpy() if isinstance(steer[0], torch.Tensor) else np.asarray(steer[0])
        if not np.any(v):
            # alpha 0 (or a zero vector) is no steering, token for token, by construction: the steered path
            # prefills the prompt without its last token and decodes that token apart, and on some CPUs (2-core
            # AMD EPYC, AVX2) that other batch shape moved a sampled row (tests/lm/test_llamacpp_backend.py)
            ms = engine.multi()
            try:
                ms.set_cvec(v, int(steer[1]))  # the same checks (residual index, size) as a real vector
            finally:
                ms.set_cvec(None)
            steer = None
    rows = [[int(x) for x in p] for p in prompts]
    for p in rows:
        if not p:
            raise ValueError("empty prompt")
        if len(p) + max_new_tokens > engine.n_ctx:
            raise UserError(f"prompt ({len(p)} tokens) + max new tokens ({max_new_tokens}) exceed the llama.cpp "
                            f"context of {engine.n_ctx}: load the engine with a larger n_ctx or lower the token caps")
    groups = [list(range(i, min(i + engine.max_rows, n))) for i in range(0, n, engine.max_rows)]
    out: list[Generation | None] = [None] * n
    engine.fed = [[] for _ in range(n)]
    engine.margins = [[] for _ in range(n)]
    for g in groups:
        for i, gen in zip(g, _decode_group(engine, [rows[i] for i in g], [temps[i] for i in g],
                                           [seeds[i] for i in g], stop_ids, max_new_tokens, top_p, g, steer)):
            out[i] = gen
    return [g for g in out if g is not None]


def _decode_group(engine: LlamaCppEngine, prompts: list[list[int]], temps: list[float], seeds: list[int | None],
                  stop_ids: dict[int, str], max_new: int, top_p: float, index: list[int],
                  steer: tuple[Any, int, str] | None = None) -> list[Generation]:
    """Decode one group of rows; row r runs in a sequence ``seq[r]``.

    A prompt that the previous group prefilled (e.g. an item whose rows straddle two groups, or every row at
    ``max_rows=1``) is kept: its sequence is trimmed back to the prompt and reused with the logits saved
    after it, instead of being prefilled again.
    """
    ms = engine.multi(max(len(p) for p in prompts) + max_new)
    if steer is not None:
        try:
            return _decode_group_steered(engine, ms, prompts, temps, seeds, stop_ids, max_new, top_p, index, steer)
        finally:
            ms.set_cvec(None)
            ms.clear()  # steered KV cells are never reused by an unsteered call
    keys = [tuple(p) for p in prompts]
    kept: dict[tuple[int, ...], tuple[int, np.ndarray]] = {}
    for sq, (key, lg) in getattr(ms, "prompts", {}).items():
        if key in keys and key not in kept:
            kept[key] = (sq, lg)
    keep_seqs = {sq for sq, _ in kept.values()}
    for sq in range(ms.max_rows):
        if sq not in keep_seqs:
            ms.L.llama_memory_seq_rm(ms.mem, sq, -1, -1)
    for key, (sq, _) in kept.items():
        ms.L.llama_memory_seq_rm(ms.mem, sq, len(key), -1)  # drop the last group's generated tokens
    home: dict[tuple[int, ...], tuple[int, np.ndarray]] = dict(kept)
    free = [sq for sq in range(ms.max_rows) if sq not in keep_seqs]
    used: set[int] = set()
    seq: list[int] = []
    for r, key in enumerate(keys):
        if key not in home:
            sq = free.pop(0)
            home[key] = (sq, ms.prefill(prompts[r], sq))
        sq = home[key][0]
        if sq in used:  # the prompt's home sequence already has a row: copy its cells to a free one
            dst = free.pop(0)
            ms.copy_seq(sq, dst)
            sq = dst
        used.add(sq)
        seq.append(sq)
        engine.fed[index[r]] = prompts[r]
    ms.prompts = {sq: (key, lg) for key, (sq, lg) in home.items()}
    logits = [home[key][1] for key in keys]
    return _decode_loop(engine, ms, prompts, seq, logits, temps, seeds, stop_ids, max_new, top_p, index)


def _decode_group_steered(engine: LlamaCppEngine, ms: _MultiSeq, prompts: list[list[int]], temps: list[float],
                          seeds: list[int | None], stop_ids: dict[int, str], max_new: int, top_p: float,
                          index: list[int], steer: tuple[Any, int, str]) -> list[Generation]:
    vec, resid, positions = steer
    vec = np.asarray(vec.detach().cpu().float() if isinstance(vec, torch.Tensor) else vec, dtype=np.float32)
    ms.clear()
    ms.set_cvec(vec if positions == "all" else None, resid)
    split = positions in ("boundary", "boundary+generated")  # the last prompt token decoded on its own
    keys = [tuple(p) for p in prompts]
    home: dict[tuple[int, ...], tuple[int, np.ndarray | None]] = {}
    free = list(range(ms.max_rows))
    seq: list[int] = []
    for r, key in enumerate(keys):
        p = prompts[r]
        if key not in home:
            sq = free.pop(0)
            body = p[:-1] if split else p
            home[key] = (sq, ms.prefill(body, sq) if body else None)
            seq.append(sq)
        else:
            dst = free.pop(0)
            ms.copy_seq(home[key][0], dst)
            seq.append(dst)
        engine.fed[index[r]] = p
    if split:
        ms.set_cvec(vec, resid)
        ms._decode([(p[-1], len(p) - 1, sq, True) for p, sq in zip(prompts, seq)])
        logits = [ms.logits(i) for i in range(len(prompts))]
    else:
        logits = [home[k][1] for k in keys]  # type: ignore[misc]
    ms.set_cvec(vec if positions in ("all", "generated", "boundary+generated") else None, resid)
    return _decode_loop(engine, ms, prompts, seq, logits, temps, seeds, stop_ids, max_new, top_p, index)


def _decode_loop(engine: LlamaCppEngine, ms: _MultiSeq, prompts: list[list[int]], seq: list[int],
                 logits: list[np.ndarray], temps: list[float], seeds: list[int | None], stop_ids: dict[int, str],
                 max_new: int, top_p: float, index: list[int]) -> list[Generation]:
    rngs = [np.random.default_rng(int(s)) if t > 0 else None for t, s in zip(temps, seeds)]
    toks: list[list[int]] = [[] for _ in prompts]
    reasons = ["max_tokens"] * len(prompts)
    active = list(range(len(prompts)))
    record = getattr(engine, "record_margins", False)
    while active:
        step: list[tuple[int, int, int, bool]] = []
        for r in active:
            if record:
                top2 = np.partition(logits[r], -2)[-2:]
                engine.margins[index[r]].append(float(top2[1] - top2[0]))
            tid = _pick(logits[r], temps[r], top_p, rngs[r])
            toks[r].append(tid)
            if tid in stop_ids:
                reasons[r] = stop_ids[tid]
            elif len(toks[r]) < max_new:
                step.append((tid, len(prompts[r]) + len(toks[r]) - 1, seq[r], True))
        active = [r for r in active if toks[r][-1] not in stop_ids and len(toks[r]) < max_new]
        if step:
            ms._decode(step)
            for i, r in enumerate(active):
                logits[r] = ms.logits(i)
    return [Generation(token_ids=t, stop_reason=why) for t, why in zip(toks, reasons)]
