"""Three ways to read the residual stream behind one interface: :func:`make_backend` / :func:`capture`.

Every backend returns, per requested position, ``[batch, len(layers), d_model]`` in residual-index
order (``r = 0``: input to block 0 = embeddings; ``r = i``: output of block ``i - 1``, before any final
norm), so results are interchangeable and checked against HF ``output_hidden_states`` in the tests.

* ``hooks`` (default, fastest): plain torch forward hooks on the decoder blocks. Each hook gathers only
  the rows it needs (advanced indexing copies them, so no view keeps the full ``[B, T, d]`` tensor
  alive), and the forward stops right after the last needed block, so the final norm and the LM head
  (for SmolLM2 the tied LM head costs as much as seven blocks) are never computed. Hooks are removed in
  ``finally``, also when the forward raises.
* ``nnsight``: nnsight 0.8's ``TransformersModel`` wrapping the already-loaded model. The same
  ``.input``/``.output`` saves run on NDIF for models no single machine holds
  (``TransformersModel("meta-llama/Llama-3.1-70B-Instruct")`` and ``trace(..., remote=True)`` with an
  NDIF API key; not testable offline, see docs/activations.md).
* ``transformer-lens``: TransformerLens 4's ``TransformerBridge`` booted from the already-loaded model
  (no hub access), reading ``blocks.{i}.hook_resid_pre`` / ``hook_resid_post``.

nnsight replaces the ``forward`` of every module it wraps and TransformerLens swaps blocks for bridge
wrappers and forces eager attention, both in place. Neither is allowed to touch the caller's model: they
get a :func:`structural_copy` (new module objects, the *same* parameter and buffer tensors), so no
weights are duplicated and in-place weight edits (e.g. a baked steering bias) are seen by every backend.
Both also get their own copy of the tokenizer, because nnsight sets ``padding_side`` and a pad token on
it, which would change the tokenizer hash that manifests pin.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mechprobe.errors import UsageError
from mechprobe.lm.choice import KV, cache_of
from mechprobe.lm.forward import get_blocks, kv_kw
from mechprobe.lm.generation import left_pad

BACKENDS = ("hooks", "nnsight", "transformer-lens")
CACHE_POSITIONS = ("boundary", "assistant_last", "assistant_mean")

# A token position spec per prompt: {"boundary": int, "span": (start, end)} in *unpadded* indices.
TokenPos = dict[str, Any]


class _StopForward(Exception):
    """Raised by the last needed hook to skip the rest of the forward pass."""


def block_output(out: Any) -> torch.Tensor:
    """The hidden state of a decoder block's output, whether it is a Tensor or a tuple.

    transformers 5 decoder layers return a Tensor; 4.x and many custom models return a tuple whose
    first element is the hidden state. ``out[0]`` on a Tensor silently takes batch row 0.
    """
    return out if isinstance(out, torch.Tensor) else out[0]


def structural_copy(model: nn.Module) -> nn.Module:
    """A deep copy of the module tree that shares every parameter and buffer tensor with ``model``.

    Wrappers that rewrite modules in place (nnsight, TransformerLens) get this instead of the
    caller's model: the original keeps its classes, ``forward`` methods and config, and no weight
    memory is duplicated.
    """
    memo: dict[int, Any] = {id(t): t for t in model.parameters()}
    memo.update({id(t): t for t in model.buffers()})
    return copy.deepcopy(model, memo)


def blocks_path(model: nn.Module) -> str:
    """Dotted attribute path of the decoder-block ``ModuleList`` (``"model.layers"`` for Llama).

    Public because steering (``mechprobe.steering.vector``) names the blocks by this path when it hooks a wrapped
    model."""
    blocks = get_blocks(model)
    for name, mod in model.named_modules():
        if mod is blocks:
            return name
    raise ValueError(f"decoder blocks of {type(model).__name__} not found")



def _check_request(prompts: Sequence[Sequence[int]], token_pos: Sequence[TokenPos], positions: Sequence[str],
                   layers: Sequence[int], n_layers: int) -> None:
    if len(prompts) != len(token_pos):
        raise ValueError(f"{len(prompts)} prompts but {len(token_pos)} token positions")
    bad = [p for p in positions if p not in CACHE_POSITIONS]
    if bad:
        raise ValueError(f"unknown positions {bad}; choose from {', '.join(CACHE_POSITIONS)}")
    bad_l = [r for r in layers if not 0 <= r <= n_layers]
    if bad_l:
        raise ValueError(f"layers {bad_l} out of range: residual indices run 0..{n_layers} (0 = embeddings)")
    for i, (p, tp) in enumerate(zip(prompts, token_pos)):
        s, e = tp["span"]
        if not 0 <= tp["boundary"] < len(p) or not 0 <= s < e <= len(p):
            raise ValueError(f"prompt {i}: boundary {tp['boundary']} / span {(s, e)} outside its {len(p)} tokens")


def padded_indices(prompts: Sequence[Sequence[int]], token_pos: Sequence[TokenPos], device: torch.device
                   ) -> dict[str, torch.Tensor]:
    """Unpadded token positions shifted into a left-padded batch of width ``max(len(p))``."""
    t = max(len(p) for p in prompts)
    pads = [t - len(p) for p in prompts]
    boundary = torch.tensor([pad + tp["boundary"] for pad, tp in zip(pads, token_pos)], device=device)
    s = torch.tensor([pad + tp["span"][0] for pad, tp in zip(pads, token_pos)], device=device)
    e = torch.tensor([pad + tp["span"][1] for pad, tp in zip(pads, token_pos)], device=device)
    ar = torch.arange(t, device=device)
    span_mask = (ar[None] >= s[:, None]) & (ar[None] < e[:, None])
    return {"boundary": boundary, "span_end": e, "span_mask": span_mask}


def select_positions(h: torch.Tensor, positions: Sequence[str], idx: dict[str, torch.Tensor]
                     ) -> dict[str, torch.Tensor]:
    """Gather the requested positions from a padded ``[B, T, d]`` hidden state (copies, never views)."""
    out: dict[str, torch.Tensor] = {}
    b = torch.arange(h.shape[0], device=h.device)
    if "boundary" in positions:
        out["boundary"] = h[b, idx["boundary"]].detach()  # advanced indexing copies
    if "assistant_last" in positions:
        out["assistant_last"] = h[b, idx["span_end"] - 1].detach()
    if "assistant_mean" in positions:
        # Mean in fp32: a bf16 sum over hundreds of tokens loses ~3 significant bits.
        m = idx["span_mask"].to(torch.float32)
        hf = h.detach().float()
        out["assistant_mean"] = torch.einsum("btd,bt->bd", hf, m) / m.sum(1, keepdim=True)
    return out


def _stack(per_layer: dict[int, dict[str, torch.Tensor]], positions: Sequence[str], layers: Sequence[int]
           ) -> dict[str, torch.Tensor]:
    return {p: torch.stack([per_layer[r][p] for r in layers], dim=1) for p in positions}


class Backend:
    """Capture residual vectors at token positions; subclasses implement :meth:`_run`.

    ``capture(prompts, token_pos, positions, layers)`` left-pads ``prompts`` (token ids, every prompt
    its own length), reads residual indices ``layers`` at ``positions`` and returns
    ``{position: [batch, len(layers), d_model]}`` in the model's dtype and device.
    """

    name = ""

    def __init__(self, model: nn.Module, tokenizer: Any = None):
        self.n_layers = len(get_blocks(model))
        # The (shared) embedding weight tells where inputs go, also after model.to(...) moved it.
        self._embed_weight = model.get_input_embeddings().weight

    @property
    def device(self) -> torch.device:
        return self._embed_weight.device

    def capture(self, prompts: Sequence[Sequence[int]], token_pos: Sequence[TokenPos], positions: Sequence[str],
                layers: Sequence[int]) -> dict[str, torch.Tensor]:
        positions, layers = list(positions), list(layers)
        _check_request(prompts, token_pos, positions, layers, self.n_layers)
        if not prompts:
            raise ValueError("no prompts to capture")
        return self._run(prompts, token_pos, positions, layers)

    def _run(self, prompts: Sequence[Sequence[int]], token_pos: Sequence[TokenPos], positions: list[str],
             layers: list[int]) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class HooksBackend(Backend):
    """Forward hooks on ``get_blocks(model)``; a pre-hook on block 0 for the embeddings (``r = 0``)."""

    name = "hooks"

    def __init__(self, model: nn.Module, tokenizer: Any = None):
        super().__init__(model, tokenizer)
        self.model = model

    @torch.inference_mode()
    def _run(self, prompts: Sequence[Sequence[int]], token_pos: Sequence[TokenPos], positions: list[str],
             layers: list[int]) -> dict[str, torch.Tensor]:
        dev = self.device
        ids, mask, pos = left_pad(prompts, 0, dev)
        idx = padded_indices(prompts, token_pos, dev)
        return self._hooked(positions, layers, idx,
                            lambda: self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False))

    @torch.inference_mode()
    def capture_continued(self, prompt: Sequence[int], boundary: int, layers: Sequence[int], kv: KV
                          ) -> torch.Tensor:
        """Residuals at ``boundary`` of one prompt whose first ``n`` tokens' keys and values are given.

        Why: the judge of a run already prefilled each conversation; with its KV only the tokens from ``n`` to the
        boundary run (usually one), instead of the whole prompt. Same values as :meth:`capture` up to float
        summation order (tested).

        Args:
            prompt: the prompt's token ids.
            boundary: the position to read (``n <= boundary < len(prompt)``).
            layers: residual indices.
            kv: (keys, values) per layer of ``prompt[:n]``, as :class:`~mechprobe.lm.choice.ChoiceScorer` keeps them.
        Returns:
            ``[len(layers), d_model]`` in the model's dtype.
        """
        n = int(kv[0][0].shape[2]) if kv else 0
        if not 0 <= n <= boundary < len(prompt):
            raise ValueError(f"boundary {boundary} must lie in [{n}, {len(prompt)}): the given keys and values cover "
                             f"{n} tokens of a {len(prompt)}-token prompt")
        dev = self.device
        layers = list(layers)
        _check_request([prompt], [{"boundary": boundary, "span": (0, 1)}], ["boundary"], layers, self.n_layers)
        ids = torch.tensor([list(prompt[n:boundary + 1])], device=dev)
        pos = torch.arange(n, boundary + 1, device=dev)[None]
        idx = {"boundary": torch.tensor([boundary - n], device=dev)}
        cache = cache_of(kv) if n else None
        got = self._hooked(["boundary"], layers, idx, lambda: self.model(
            input_ids=ids, position_ids=pos, use_cache=cache is not None, **kv_kw(self.model, cache)))
        return got["boundary"][0]

    def _hooked(self, positions: list[str], layers: list[int], idx: dict[str, torch.Tensor], forward: Any
                ) -> dict[str, torch.Tensor]:
        """Run ``forward`` with hooks reading ``positions`` at residual indices ``layers``; the hooks are removed
        whatever happens, and the forward stops after the last layer read."""
        blocks = get_blocks(self.model)
        dev = self.device
        got: dict[int, dict[str, torch.Tensor]] = {}
        last = max(layers)
        handles = []

        def post_hook(r: int):
            def fn(_m: nn.Module, _inp: Any, out: Any) -> None:
                h = block_output(out)
                got[r] = select_positions(h, positions, {k: v.to(h.device) for k, v in idx.items()})
                if r == last:
                    raise _StopForward
            return fn

        def pre_hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            h = args[0] if args else kwargs["hidden_states"]
            got[0] = select_positions(h, positions, {k: v.to(h.device) for k, v in idx.items()})
            if last == 0:
                raise _StopForward

        try:
            if 0 in layers:
                handles.append(blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True))
            for r in layers:
                if r > 0:
                    handles.append(blocks[r - 1].register_forward_hook(post_hook(r)))
            try:
                forward()
            except _StopForward:
                pass
        finally:
            for h in handles:
                h.remove()
        return _stack({r: {p: v.to(dev) for p, v in d.items()} for r, d in got.items()}, positions, layers)


def _require_tokenizer(tokenizer: Any, backend: str) -> None:
    if tokenizer is None:
        raise ValueError(f"the {backend} backend needs the model's tokenizer (it would otherwise try to download "
                         "one): pass tokenizer=... (LoadedModel.tokenizer)")


class NnsightBackend(Backend):
    """nnsight ``TransformersModel`` over a structural copy; saves block inputs/outputs in forward order."""

    name = "nnsight"

    def __init__(self, model: nn.Module, tokenizer: Any = None):
        super().__init__(model, tokenizer)
        _require_tokenizer(tokenizer, self.name)
        try:
            from nnsight.modeling.transformers import TransformersModel as Wrapper  # lazy: extra [backends]
        except ImportError:  # nnsight < 0.8
            from nnsight import LanguageModel as Wrapper  # lazy: extra [backends]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.wrapped = Wrapper(structural_copy(model), tokenizer=copy.deepcopy(tokenizer))
        env: Any = self.wrapped
        for part in blocks_path(model).split("."):
            env = getattr(env, part)
        self.blocks = env

    def _run(self, prompts: Sequence[Sequence[int]], token_pos: Sequence[TokenPos], positions: list[str],
             layers: list[int]) -> dict[str, torch.Tensor]:
        import nnsight  # lazy: extra [backends]

        dev = self.device
        ids, mask, pos = left_pad(prompts, 0, dev)
        idx = padded_indices(prompts, token_pos, dev)
        saved: dict[int, Any] = {}
        # nnsight 0.8 requires modules to be touched in forward order: block 0's input, then outputs ascending.
        # The row selection runs inside the trace, so only [B, d] per layer is kept (and, remotely, downloaded);
        # tracer.stop() skips the blocks after the last one read, the final norm and the LM head.
        with torch.inference_mode(), self.wrapped.trace({"input_ids": ids, "attention_mask": mask,
                                                         "position_ids": pos}) as tracer:
            for r in sorted(layers):
                h = self.blocks[0].input if r == 0 else self.blocks[r - 1].output
                saved[r] = nnsight.save(select_positions(block_output(h), positions, idx))
            tracer.stop()
        return _stack(saved, positions, layers)


class TransformerLensBackend(Backend):
    """TransformerLens 4 ``TransformerBridge`` over a structural copy; batched with mask and positions."""

    name = "transformer-lens"

    def __init__(self, model: nn.Module, tokenizer: Any = None):
        super().__init__(model, tokenizer)
        _require_tokenizer(tokenizer, self.name)
        if not getattr(tokenizer, "name_or_path", ""):
            # boot_transformers re-loads the tokenizer from name_or_path (to add a BOS flag): KeyError otherwise.
            raise ValueError("TransformerLens re-loads the tokenizer from tokenizer.name_or_path, which this in-memory "
                             "tokenizer lacks: save_pretrained() it to a directory and load it from there")
        from transformer_lens.model_bridge import TransformerBridge  # lazy: extra [backends]

        twin = structural_copy(model)
        if not getattr(twin.config, "architectures", None):
            # GGUF-loaded configs carry architectures=None; the bridge picks its adapter from it.
            twin.config.architectures = [type(model).__name__]
        p = next(model.parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.bridge = TransformerBridge.boot_transformers(
                type(model).__name__, hf_model=twin, tokenizer=copy.deepcopy(tokenizer), device=str(p.device),
                dtype=p.dtype)

    def _run(self, prompts: Sequence[Sequence[int]], token_pos: Sequence[TokenPos], positions: list[str],
             layers: list[int]) -> dict[str, torch.Tensor]:
        dev = self.device
        # Token ids, never text: to_tokens on templated text prepends a second BOS.
        ids, mask, pos = left_pad(prompts, 0, dev)
        idx = padded_indices(prompts, token_pos, dev)
        names = {r: ("blocks.0.hook_resid_pre" if r == 0 else f"blocks.{r - 1}.hook_resid_post") for r in layers}
        wanted = set(names.values())
        last = max(layers)
        stop = None if last >= self.n_layers else max(last, 1)  # skip blocks (and the LM head) nobody reads
        with torch.inference_mode():
            _, cache = self.bridge.run_with_cache(ids, names_filter=lambda n: n in wanted, attention_mask=mask,
                                                  position_ids=pos, stop_at_layer=stop)
        got = {r: select_positions(cache[names[r]], positions, idx) for r in layers}
        return _stack(got, positions, layers)


_CLASSES: dict[str, type[Backend]] = {"hooks": HooksBackend, "nnsight": NnsightBackend,
                                      "transformer-lens": TransformerLensBackend}
# Prepared wrappers per live model, so repeated capture() calls don't re-wrap. Weak keys: a dropped model
# frees its wrappers (an id()-keyed dict would leak them and could hand a new model an old wrapper). The
# wrappers hold only the structural copy, never the key itself, or the key could never be collected.
_PREPARED: weakref.WeakKeyDictionary[nn.Module, dict[str, Backend]] = weakref.WeakKeyDictionary()


def make_backend(name: str, model: nn.Module, tokenizer: Any = None) -> Backend:
    """A fresh backend over ``model``; nnsight and TransformerLens wrap a structural copy of it."""
    if name not in _CLASSES:
        raise UsageError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
    return _CLASSES[name](model, tokenizer)


def capture(model: nn.Module, prompts: Sequence[Sequence[int]], token_pos: Sequence[TokenPos],
            positions: Sequence[str], layers: Sequence[int], *, backend: str = "hooks", tokenizer: Any = None
            ) -> dict[str, torch.Tensor]:
    """Residual vectors at ``positions`` for residual indices ``layers`` (see the module docstring).

    ``token_pos[i]`` is ``{"boundary": int, "span": (start, end)}`` in prompt ``i``'s unpadded indices.
    The backend wrapper is built once per (model, backend, tokenizer) and reused.
    """
    if backend not in _CLASSES:
        raise UsageError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    if backend == "hooks":  # stateless: nothing to prepare (and it must not be cached: it holds the model)
        return HooksBackend(model).capture(prompts, token_pos, positions, layers)
    per_model = _PREPARED.setdefault(model, {})
    if backend not in per_model:
        per_model[backend] = make_backend(backend, model, tokenizer)
    return per_model[backend].capture(prompts, token_pos, positions, layers)
