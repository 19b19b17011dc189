"""The registry of judge kinds and the parsed judge spec: the one place that knows how a spec string reads.

A judge spec is ``KIND`` (``offline``) or ``KIND:MODEL`` (``hybrid-voice:qwen2.5-coder-1.5b-instruct``).
:meth:`JudgeSpec.parse` splits it once (aliases resolved, the kind checked against the registry, the model
required or refused as the kind says); the factory, the spec checks, the CLI help and the routing of constructor
options all read the parsed :class:`JudgeSpec` and the kind's :class:`JudgeKind`, never the string.

A kind is registered with :func:`register_judge` in one module under :mod:`mechprobe.judges.kinds` (every module
there is imported when that package loads), so a new judge is that one module plus its test. ``auto`` is not a
kind: it is resolved to one by :func:`mechprobe.judges.factory.resolve_judge_spec`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mechprobe.errors import UsageError

__all__ = ["AUTO", "BEST_JUDGE", "OFFLINE_JUDGE", "JudgeKind", "JudgeSpec", "judge_help", "judge_kind", "judge_kinds", "register_judge"]

AUTO = "auto"
"""The spec every command defaults to: the default-judge rule picks a concrete kind (never a registered kind)."""

# The two judges the package's defaults name, written here once (every default below imports them):
BEST_JUDGE = "hidden:qwen2.5-coder-0.5b-instruct"
"""The research default: the judge that agrees best with blind labels on the Qwen models' once-scored test items
(docs/findings.md, "Judges vs blind labels"; the hidden-state judge's strict head, 3.6x the speed of the
``hybrid-voice:`` judge it replaced). ``auto`` picks it where its reader is fetched
(:func:`mechprobe.judges.factory.best_judge`); the post-training evaluation and new study roots get it through
``auto``."""
OFFLINE_JUDGE = "offline"
"""The judge that loads no model (the rules): the default of a config or function that must run anywhere and fast
(``StudyConfig.judge``, :func:`~mechprobe.judges.factory.make_judge`, :func:`~mechprobe.judges.run.judge_run`),
and ``auto``'s choice where :data:`BEST_JUDGE`'s model is missing."""


@dataclass(frozen=True)
class JudgeKind:
    """One registered judge kind: how its spec reads, which options its constructor takes, how it is built.

    Args:
        kind: the spec's kind (the part before ``:``).
        build: ``build(spec, **opts) -> Judge``; ``opts`` are already reduced to :attr:`options`.
        model: ``"required"`` (``KIND:MODEL``), ``"none"`` (``KIND`` alone).
        options: constructor options the judge takes; any other option handed to the factory is dropped, so a
            command can pass all its judge options whatever the kind.
        loads_model: the model after ``:`` is a local language model (an embedded name, a HF directory, a .gguf):
            checked before a long command starts, and shared with a subject model of the same weights.
        help: a few words for ``--judge``'s help.
        example: a model name for messages (``KIND:example``).
        aliases: other kinds accepted for this one (``hybrid2`` for ``hybrid-voice``).
        spec_of_name: the spec that rebuilds a judge recorded in ``labels.jsonl`` by its name, or None (how
            ``auto`` resumes a run with the judge that labelled it).
        order: place in help texts and lists (lower first).
    """

    kind: str
    build: Callable[..., Any]
    model: str
    options: frozenset[str]
    loads_model: bool = False
    help: str = ""
    example: str = "MODEL"
    aliases: tuple[str, ...] = ()
    spec_of_name: Callable[[str], str | None] | None = None
    order: int = 100

    @property
    def usage(self) -> str:
        """How the spec is written (``hybrid-voice:MODEL (alias hybrid2:MODEL)``)."""
        tail = ":MODEL" if self.model == "required" else ""
        alias = "".join(f" (alias {a}{tail})" for a in self.aliases)
        return f"{self.kind}{tail}{alias}"


_KINDS: dict[str, JudgeKind] = {}
_ALIASES: dict[str, str] = {}


def register_judge(kind: str, *, model: str = "required", options: tuple[str, ...] = (), loads_model: bool = False,
                   help: str = "", example: str = "MODEL", aliases: tuple[str, ...] = (),
                   spec_of_name: Callable[[str], str | None] | None = None,
                   order: int = 100) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``build(spec: JudgeSpec, **opts) -> Judge`` as the judge kind ``kind`` (a decorator).

    Args:
        kind: the spec's kind; no ``:`` and not ``auto``.
        model: ``"required"`` or ``"none"`` (see :class:`JudgeKind`).
        options: the constructor options the judge takes.
        loads_model: whether the model after ``:`` is a local language model.
        help: a few words for ``--judge``'s help.
        example: a model name for messages.
        aliases: other kinds that mean this one.
        spec_of_name: recorded judge name -> spec, or None.
        order: place in help texts.

    Returns:
        The decorator; it returns the builder unchanged.

    Raises:
        UsageError: a malformed kind, or one (or an alias) registered twice.

    Example:
        >>> from mechprobe.judges.registry import judge_kinds
        >>> "offline" in judge_kinds() and "trained" in judge_kinds()
        True
    """
    if not kind or ":" in kind or kind == AUTO or model not in ("required", "none"):
        raise UsageError(f"judge kind {kind!r} (model={model!r}): a kind has no ':', is not 'auto', and its model is "
                         "'required' or 'none'")

    def deco(build: Callable[..., Any]) -> Callable[..., Any]:
        for name in (kind, *aliases):
            owner = _ALIASES.get(name, name if name in _KINDS else None)
            if owner is not None and _KINDS[owner].build is not build:
                raise UsageError(f"judge kind {name!r} is registered twice; give the new judge another kind")
        _KINDS[kind] = JudgeKind(kind, build, model, frozenset(options), loads_model, help, example, tuple(aliases),
                                 spec_of_name, order)
        for a in aliases:
            _ALIASES[a] = kind
        return build
    return deco


def judge_kinds() -> tuple[str, ...]:
    """Every registered kind, in help order (aliases not included)."""
    return tuple(k.kind for k in sorted(_KINDS.values(), key=lambda k: (k.order, k.kind)))


def judge_kind(kind: str) -> JudgeKind:
    """The registered kind ``kind`` (an alias gives its kind); a :class:`UsageError` naming the kinds otherwise."""
    name = _ALIASES.get(kind, kind)
    if name not in _KINDS:
        raise UsageError(f"judge={kind!r}: unknown judge; use one of {_usages()}")
    return _KINDS[name]


def _usages() -> str:
    return ", ".join(f"'{_KINDS[k].usage}'" for k in judge_kinds())


def judge_help() -> str:
    """Every spec form, for ``--judge``'s help (``offline | ... | trained:MODEL``), from the registry."""
    return " | ".join(_KINDS[k].usage for k in judge_kinds())


@dataclass(frozen=True)
class JudgeSpec:
    """A parsed judge spec: the registered kind (alias resolved) and the model, when the kind takes one.

    ``str(spec)`` is the canonical spec string (``hybrid2:M`` parses to ``hybrid-voice:M``), the form every
    comparison of specs uses.

    Example:
        >>> s = JudgeSpec.parse("hybrid2:qwen2.5-coder-1.5b-instruct")
        >>> s.kind, s.model, str(s)
        ('hybrid-voice', 'qwen2.5-coder-1.5b-instruct', 'hybrid-voice:qwen2.5-coder-1.5b-instruct')
        >>> str(JudgeSpec.parse("offline")), JudgeSpec.parse("offline").model is None
        ('offline', True)
    """

    kind: str
    model: str | None = None

    def __str__(self) -> str:
        return f"{self.kind}:{self.model}" if self.model is not None else self.kind

    @property
    def judge_kind(self) -> JudgeKind:
        """The registered :class:`JudgeKind` of this spec."""
        return judge_kind(self.kind)

    @classmethod
    def parse(cls, spec: str | JudgeSpec, field: str = "judge") -> JudgeSpec:
        """Split ``spec`` once: ``KIND`` or ``KIND:MODEL``, the kind registered, the model as the kind requires.

        Args:
            spec: a spec string (not ``auto``: resolve that first) or a parsed spec (returned as is).
            field: the setting named in errors (``judge``; the CLI shows it as ``--judge``).

        Returns:
            The :class:`JudgeSpec`.

        Raises:
            UsageError: not a string, ``auto``, an unknown kind, a missing model or a model the kind does not take.
        """
        if isinstance(spec, JudgeSpec):
            return spec
        if not isinstance(spec, str) or spec == AUTO:
            raise UsageError(f"{field}={spec!r}: not a judge spec to build; use one of {_usages()} (resolve 'auto' "
                             "with resolve_judge_spec first)")
        name, sep, model = spec.partition(":")
        k = _KINDS.get(_ALIASES.get(name, name))
        if k is None:
            raise UsageError(f"{field}={spec!r}: unknown judge; use one of {_usages()}")
        if k.model == "none" and sep:
            raise UsageError(f"{field}={spec!r}: the {k.kind} judge takes no model; pass {field}={k.kind}")
        if k.model == "required" and not model:
            raise UsageError(f"{field}={spec!r}: {k.kind}:MODEL needs a model name, e.g. {k.kind}:{k.example}")
        return cls(k.kind, model if sep else None)
