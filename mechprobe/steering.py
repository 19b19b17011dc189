"""Steering vectors: build them from boundary activations, add them to the residual stream, bake them in.

**What ``alpha`` multiplies** (CAA convention): the steered residual is ``h + alpha * v`` where ``v`` is
the *raw* difference of means ``mean(h | genuine) - mean(h | not genuine)`` at the chosen residual
index. ``alpha = 1`` moves the average non-follow-up boundary state onto the average follow-up state.
Probe directions (unit vectors) are rescaled to the difference-of-means norm of the same layer, so
alphas are comparable across vector kinds. :meth:`SteeringVector.describe` prints ``|v|`` relative to the
layer's mean residual norm, the number that says whether an alpha is gentle or destructive.

**Where it is added** (residual index ``r``, same convention as :mod:`mechprobe.activations`): to the
output of block ``r - 1`` (``r = 0``: the input of block 0), at

* ``boundary``: the last prompt position of the prefill call (the probe prompt ends at the user-role
  boundary, and left padding keeps it last in every row);
* ``generated``: every decode call (one new token per call with a KV cache);
* ``boundary+generated``: both; ``all``: every position of every call (what a baked bias does).

Why the prefill/decode split is by sequence length: with a KV cache, HF ``generate`` and
:func:`mechprobe.generation.generate` call the model once on the whole prompt and then once per token
with ``seq_len == 1``. Without a KV cache (``use_cache=False``) every call sees the whole sequence, and
``boundary`` would hit the newest token instead: mechprobe always decodes with the cache.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .models import get_blocks

POSITIONS = ("boundary", "generated", "boundary+generated", "all")


@dataclass
class SteeringVector:
    """A direction in the residual stream at residual index ``layer`` (0 = embeddings)."""

    vector: torch.Tensor
    layer: int
    kind: str = "diff_means"  # diff_means | probe | random | negative
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def norm(self) -> float:
        return float(self.vector.float().norm())

    def describe(self) -> str:
        ref = self.meta.get("resid_norm")
        rel = f", {self.norm / ref:.3f} x mean residual norm ({ref:.2f})" if ref else ""
        return f"{self.kind} vector at residual index {self.layer}: |v| = {self.norm:.3f}{rel}"

    def negated(self) -> SteeringVector:
        return SteeringVector(-self.vector, self.layer, "negative", {**self.meta, "source_kind": self.kind})

    def random_like(self, seed: int = 0) -> SteeringVector:
        """A random direction of equal norm: the control that separates 'this direction' from 'any push'."""
        g = torch.Generator().manual_seed(seed)
        r = torch.randn(self.vector.shape, generator=g)
        r = r / r.norm() * self.norm
        return SteeringVector(r.to(self.vector.dtype), self.layer, "random", {**self.meta, "seed": seed})

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"vector": self.vector.detach().float().contiguous().cpu()}, str(path.with_suffix(".safetensors")))
        path.with_suffix(".json").write_text(json.dumps({"layer": self.layer, "kind": self.kind, "meta": self.meta},
                                                        indent=2, default=str))
        return path.with_suffix(".safetensors")

    @classmethod
    def load(cls, path: str | Path) -> SteeringVector:
        from safetensors.torch import load_file

        path = Path(path)
        info = json.loads(path.with_suffix(".json").read_text())
        v = load_file(str(path.with_suffix(".safetensors")))["vector"]
        return cls(v, int(info["layer"]), info["kind"], info.get("meta", {}))


def diff_of_means(x_pos: torch.Tensor, x_neg: torch.Tensor, layer: int, **meta: Any) -> SteeringVector:
    """``mean(x_pos) - mean(x_neg)``; records class sizes and the mean residual norm for :meth:`describe`."""
    if len(x_pos) == 0 or len(x_neg) == 0:
        raise ValueError(f"need examples of both classes (got {len(x_pos)} positive, {len(x_neg)} negative)")
    x_pos, x_neg = x_pos.float(), x_neg.float()
    v = x_pos.mean(0) - x_neg.mean(0)
    resid_norm = float(torch.cat([x_pos, x_neg]).norm(dim=-1).mean())
    return SteeringVector(v, layer, "diff_means", {"n_pos": len(x_pos), "n_neg": len(x_neg),
                                                   "resid_norm": resid_norm, **meta})


def from_direction(direction: torch.Tensor, layer: int, scale: float, kind: str = "probe", **meta: Any
                   ) -> SteeringVector:
    """A unit direction scaled to ``scale`` (use the same layer's difference-of-means norm)."""
    d = direction.float()
    return SteeringVector(d / d.norm() * scale, layer, kind, dict(meta))


def _positions_mask(seq_len: int, positions: str) -> slice | None:
    if positions == "all":
        return slice(None)
    if seq_len > 1:  # prefill: the whole prompt; the boundary is its last position
        return slice(seq_len - 1, seq_len) if "boundary" in positions else None
    return slice(None) if "generated" in positions else None


@contextlib.contextmanager
def steer(model: nn.Module, vector: SteeringVector, alpha: float, positions: str = "boundary+generated"
          ) -> Iterator[None]:
    """Add ``alpha * vector`` to the residual stream while the context is open; hooks always removed.

    Works with any forward-based decoding that uses a KV cache (mechprobe's ``generate``, HF
    ``generate``). ``alpha == 0`` adds nothing, so outputs are token-identical to no steering.
    """
    if positions not in POSITIONS:
        raise ValueError(f"positions must be one of {', '.join(POSITIONS)}")
    blocks = get_blocks(model)
    if not 0 <= vector.layer <= len(blocks):
        raise ValueError(f"layer {vector.layer} out of range 0..{len(blocks)} (residual index)")
    cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def delta(h: torch.Tensor) -> torch.Tensor:
        key = (h.device, h.dtype)
        if key not in cache:
            cache[key] = (alpha * vector.vector.float()).to(device=h.device, dtype=h.dtype)
        return cache[key]

    def add(h: torch.Tensor) -> torch.Tensor:
        sl = _positions_mask(h.shape[1], positions)
        if sl is None or alpha == 0:
            return h
        if torch.is_grad_enabled():
            h = h.clone()  # autograd may need the unedited output; under no_grad/inference edit in place
        h[:, sl] += delta(h)
        return h

    def post_hook(_m: nn.Module, _inp: Any, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return add(out)
        return (add(out[0]), *out[1:])

    def pre_hook(_m: nn.Module, args: tuple, kwargs: dict) -> Any:
        if args:
            return (add(args[0]), *args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = add(kwargs["hidden_states"])
        return args, kwargs

    if vector.layer == 0:
        handle = blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
    else:
        handle = blocks[vector.layer - 1].register_forward_hook(post_hook)
    try:
        yield
    finally:
        handle.remove()


def bake(model: nn.Module, vector: SteeringVector, alpha: float) -> nn.Module:
    """Fold ``alpha * v`` into the weights as a bias on block ``layer - 1``'s MLP output projection.

    The result is a standard HF model (``save_pretrained`` / ``from_pretrained``) that steers at *every*
    position (``positions="all"``), unlike boundary-only steering. Supported where the config has an
    ``mlp_bias`` switch (Llama family, incl. SmolLM2); other families raise ``NotImplementedError``.
    The model is modified in place and returned.
    """
    cfg = model.config
    if vector.layer < 1:
        raise ValueError("baking needs a block output (layer >= 1)")
    if not hasattr(cfg, "mlp_bias"):
        raise NotImplementedError(f"{type(model).__name__} has no mlp_bias config switch; steer with hooks instead")
    blocks = get_blocks(model)
    for i, blk in enumerate(blocks):
        mlp = blk.mlp
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin: nn.Linear = getattr(mlp, name)
            if lin.bias is None:
                new = nn.Linear(lin.in_features, lin.out_features, bias=True, device=lin.weight.device,
                                dtype=lin.weight.dtype)
                new.weight = lin.weight
                nn.init.zeros_(new.bias)
                setattr(mlp, name, new)
        if i == vector.layer - 1:
            with torch.no_grad():
                mlp.down_proj.bias += (alpha * vector.vector.float()).to(mlp.down_proj.bias)
    cfg.mlp_bias = True
    return model


def generate_nnsight(model: nn.Module, tokenizer: Any, prompts: list[list[int]], vector: SteeringVector, alpha: float,
                     positions: str = "boundary+generated", max_new_tokens: int = 32, pad_id: int = 0) -> list[list[int]]:
    """Greedy steered generation through nnsight (same semantics as :func:`steer` + HF ``generate``).

    This is the path for models served by NDIF (pass a remote ``LanguageModel`` and ``remote=True``
    to the trace in your own code). nnsight 0.8 specifics: every decode step needs ``tracer.all()``;
    code after that open-ended loop never runs in the same invoke, so the generated ids are read in a
    second ``tracer.invoke()``. Returns the new token ids per prompt (fixed ``max_new_tokens``).
    """
    import warnings

    from nnsight import LanguageModel

    from .backends import _blocks_path
    from .generation import input_device, left_pad

    if positions not in POSITIONS:
        raise ValueError(f"positions must be one of {', '.join(POSITIONS)}")
    if vector.layer < 1:
        raise ValueError("nnsight steering needs a block output (layer >= 1)")
    side = getattr(tokenizer, "padding_side", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nm = LanguageModel(model, tokenizer=tokenizer)
        if side is not None:
            tokenizer.padding_side = side
        ids, mask, _ = left_pad(prompts, pad_id, input_device(model))
        delta = (alpha * vector.vector.float()).to(device=input_device(model))
        env: Any = nm
        for part in _blocks_path(model).split("."):
            env = getattr(env, part)
        block = env[vector.layer - 1]
        with nm.generate(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=pad_id) as tracer:
            with tracer.invoke({"input_ids": ids, "attention_mask": mask}):
                for _step in tracer.all():
                    h = block.output
                    if positions == "all":
                        h[:, :] += delta.to(h.dtype)
                    elif h.shape[1] > 1:
                        if "boundary" in positions:
                            h[:, -1] += delta.to(h.dtype)
                    elif "generated" in positions:
                        h[:, :] += delta.to(h.dtype)
            with tracer.invoke():
                out = nm.generator.output.save()
    return out[:, ids.shape[1]:].tolist()
