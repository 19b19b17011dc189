"""The judge stage: label every generated user turn of a probe run, resumably.

``judge_run(RUN)`` reads ``RUN/user_turns.jsonl`` and ``RUN/assistant.jsonl``, asks a judge for one
:class:`~mechprobe.records.LabelRecord` per user turn and appends it to ``RUN/labels.jsonl`` as soon as
it is known, so a killed run loses at most the rows in flight and a re-run only labels what is
missing. Two judges share one interface (:class:`Judge`):

* ``offline`` (:mod:`mechprobe.judge_offline`): deterministic rules, no network; the default.
* ``openai:MODEL`` (:mod:`mechprobe.judge_llm`): an LLM behind any OpenAI-compatible endpoint.
* ``local:MODEL`` (:mod:`mechprobe.judge_local`): the same prompt, in-process, verdict by constrained choice.

Why ``judge_error`` rows are dropped and retried on the next run: an error is a fact about the
endpoint at one moment (rate limit, outage), not about the user turn, and counting it as any label
would bias the follow-up rate. Errors are kept in the file until then so the summary can report them.

Why one labels file holds one judge: mixing two judges' rows in one file would make every rate a
blend of two instruments. A second judge writes a second file (``--labels labels_llm.jsonl``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from .errors import MissingInput, UsageError, UserError
from .io import JsonlStore, dumps_row, read_json, read_jsonl, versions, write_json, writer_lock
from .records import AssistantRecord, LabelRecord, UserTurnRecord
from .stats import wilson
from .taxonomy import GENUINE, JUDGE_ERROR, LABELS, TAXONOMY_VERSION

LABELS_FILE = "labels.jsonl"
USER_TURNS = "user_turns.jsonl"
ASSISTANT = "assistant.jsonl"


@dataclass(frozen=True)
class JudgeInput:
    """What a judge sees about one user turn: the conversation and the raw generated text.

    ``raw_text`` keeps special tokens (an opened assistant header is evidence); ``text`` is the
    cleaned turn when the probe stage provided one. ``messages`` is any conversation *before*
    ``prompt``. Group fields (dataset, decoding, temperature) are only used by summaries.
    """

    record_id: str
    prompt: str
    response: str
    raw_text: str
    text: str | None = None
    messages: tuple[tuple[str, str], ...] = ()
    stop_reason: str | None = None
    dataset: str = ""
    decoding: str = ""
    temperature: float = 0.0
    item_id: str = ""

    def conversation(self) -> list[dict[str, str]]:
        """History + user query + assistant response as chat messages."""
        msgs = [{"role": r, "content": c} for r, c in self.messages]
        return msgs + [{"role": "user", "content": self.prompt}, {"role": "assistant", "content": self.response}]


class Judge(Protocol):
    """Anything that turns :class:`JudgeInput` rows into :class:`LabelRecord` rows."""

    name: str

    def label_many(self, inputs: Sequence[JudgeInput]) -> Iterator[LabelRecord]:
        """Yield one record per input, in any order, as soon as each is known."""
        ...


class JudgeMismatch(UserError, RuntimeError):
    """A labels file already holds rows from a different judge."""


# --------------------------------------------------------------------------- inputs


def _msgs(messages: Iterable[dict[str, str]] | None) -> tuple[tuple[str, str], ...]:
    return tuple((str(m.get("role", "")), str(m.get("content", ""))) for m in (messages or []))


def inputs_from_run(run_dir: str | Path) -> list[JudgeInput]:
    """Join a probe run's user turns with their assistant turns (by ``item_id``)."""
    run_dir = Path(run_dir)
    if not (run_dir / USER_TURNS).exists():
        raise MissingInput(
            f"{run_dir} has no {USER_TURNS}: run the probe stage first "
            f"(`mechprobe probe --out {run_dir}`), or pass the directory that holds it")
    assistants = {r["item_id"]: AssistantRecord.from_dict(r) for r in read_jsonl(run_dir / ASSISTANT, key="item_id")}
    out: list[JudgeInput] = []
    missing: list[str] = []
    for row in read_jsonl(run_dir / USER_TURNS, key="record_id"):
        u = UserTurnRecord.from_dict(row)
        a = assistants.get(u.item_id)
        if a is None:
            missing.append(u.item_id)
            continue
        out.append(JudgeInput(record_id=u.record_id, prompt=a.prompt, response=a.response, raw_text=u.raw_text,
                              text=u.text, messages=_msgs(a.messages), stop_reason=u.stop_reason,
                              dataset=u.dataset, decoding=u.decoding, temperature=u.temperature,
                              item_id=u.item_id))
    if missing:
        raise UsageError(f"{run_dir / USER_TURNS} has user turns for items missing from {ASSISTANT} "
                         f"(e.g. {sorted(set(missing))[:3]}); the run is damaged: re-run the probe stage "
                         f"on {run_dir} to regenerate them")
    return out


def inputs_from_rows(rows: Iterable[dict[str, Any]]) -> list[JudgeInput]:
    """Inputs from self-contained rows (the hand-label fixture format: prompt, response, raw_text, ...)."""
    out = []
    for i, r in enumerate(rows):
        need = [k for k in ("record_id", "prompt", "response", "raw_text") if k not in r]
        if need:
            raise UsageError(f"row {i} lacks {need}: a self-contained label row needs record_id, prompt, "
                             "response and raw_text (the hand-label fixture format)")
        out.append(JudgeInput(record_id=str(r["record_id"]), prompt=r["prompt"], response=r["response"],
                              raw_text=r["raw_text"], text=r.get("text"), messages=_msgs(r.get("messages")),
                              stop_reason=r.get("stop_reason"), dataset=r.get("dataset", ""),
                              decoding=r.get("decoding", ""), temperature=float(r.get("temperature", 0.0)),
                              item_id=r.get("item_id", "")))
    return out


# --------------------------------------------------------------------------- judges


BEST_JUDGE = "hybrid2:qwen2.5-coder-1.5b-instruct"


def best_judge() -> str:
    """The best-validated judge this machine can run (docs/judge_agreement.md): the hybrid judge with the voice check
    on the 1.5B model when that model is fetched, else the offline rules (reports name whichever labelled them).

    Why a function, not a constant: a fresh machine without the 1.5B weights must still run every entry point."""
    why = model_unavailable(BEST_JUDGE.split(":", 1)[1])
    if why:
        print(f"judge: offline ({BEST_JUDGE} needs the model: {why})", file=sys.stderr)
        return "offline"
    return BEST_JUDGE


def model_unavailable(model: str) -> str | None:
    """Why ``model`` cannot run here (weights not fetched), or None. Only embedded names are checked:
    a HF id or path fails at load time with its own message."""
    from .models import EMBEDDED, ModelLoadError, embedded_gguf_path

    if model not in EMBEDDED:
        return None
    try:
        embedded_gguf_path(model)
    except ModelLoadError as e:
        return str(e)
    return None


def resolve_judge_spec(spec: str | None) -> str:
    """``None`` means: ``openai:$MECHPROBE_JUDGE_MODEL`` when that is set, else ``offline``."""
    if spec:
        return spec
    model = os.environ.get("MECHPROBE_JUDGE_MODEL")
    return f"openai:{model}" if model else "offline"


def make_judge(spec: str | None = "offline", **opts: Any) -> Judge:
    """Build a judge from ``offline``, ``offline-lexical`` (no embedding model), ``openai:MODEL`` or ``local:MODEL``.

    ``opts`` go to the judge's constructor (``base_url``, ``api_key``, ``concurrency``, ``timeout``,
    ``max_retries``, ``cache_dir`` for the LLM judge; ``embed`` for the offline one). Unused ``None``
    options are ignored, so CLI arguments can be passed through unconditionally.
    """
    spec = resolve_judge_spec(spec)
    opts = {k: v for k, v in opts.items() if v is not None}
    if spec in ("offline", "offline-lexical", "offline-embed"):
        from .judge_offline import OfflineJudge

        allowed = {"embed", "batch_size"}
        if spec == "offline-lexical":
            opts["embed"] = False
        elif spec == "offline-embed":
            opts["embed"] = True
        return OfflineJudge(**{k: v for k, v in opts.items() if k in allowed})
    if spec.startswith("openai:"):
        model = spec.split(":", 1)[1]
        if not model:
            raise UsageError("--judge openai:MODEL needs a model name, e.g. openai:gpt-4o-mini")
        from .judge_llm import LLMJudge

        allowed = {"base_url", "api_key", "concurrency", "timeout", "max_retries", "cache_dir",
                   "backoff", "max_backoff", "structured", "max_tokens"}
        return LLMJudge(model, **{k: v for k, v in opts.items() if k in allowed})
    if spec.startswith("local:"):
        model = spec.split(":", 1)[1]
        if not model:
            raise UsageError("--judge local:MODEL needs a model: an embedded name (e.g. "
                             "local:qwen2.5-coder-1.5b-instruct), a HF model directory or a .gguf file")
        from .judge_local import LocalJudge

        allowed = {"dtype", "device", "few_shot", "bias", "cache_dir", "loaded"}
        return LocalJudge(model, **{k: v for k, v in opts.items() if k in allowed})
    if spec.startswith(("hybrid:", "hybrid2:")):
        model = spec.split(":", 1)[1]
        if not model:
            raise UsageError("--judge hybrid:MODEL needs a model: an embedded name (e.g. "
                             "hybrid:qwen2.5-coder-1.5b-instruct), a HF model directory or a .gguf file")
        from .judge_hybrid import HybridJudge

        allowed = {"dtype", "device", "threshold", "veto", "cache_dir", "loaded", "embed", "voice"}
        kw = {k: v for k, v in opts.items() if k in allowed}
        if spec.startswith("hybrid2:"):  # + the voice check at the margin chosen on the dev splits
            from .judge_hybrid import DEFAULT_VOICE

            kw.setdefault("voice", DEFAULT_VOICE)
        return HybridJudge(model, **kw)
    raise UsageError(f"unknown judge {spec!r}: use 'offline', 'offline-lexical', 'openai:MODEL', 'local:MODEL', "
                     "'hybrid:MODEL' or 'hybrid2:MODEL'")


def check_judge_spec(spec: str | None, flag: str = "--judge") -> str:
    """Parse a judge spec without building the judge (nothing is loaded): the resolved spec, or a
    :class:`UsageError`. The model of ``local:``/``hybrid:``/``hybrid2:`` must be a known model source
    (:func:`mechprobe.models.check_model_source`). Lets a long command refuse a typo before its first model loads."""
    from .models import check_model_source

    spec = resolve_judge_spec(spec)
    if spec in ("offline", "offline-lexical", "offline-embed"):
        return spec
    kind, _, model = spec.partition(":")
    if kind not in ("openai", "local", "hybrid", "hybrid2") or not _:
        raise UsageError(f"unknown judge {spec!r} ({flag}): use 'offline', 'offline-lexical', 'openai:MODEL', "
                         "'local:MODEL', 'hybrid:MODEL' or 'hybrid2:MODEL'")
    if not model:
        raise UsageError(f"{flag} {kind}:MODEL needs a model name, e.g. {kind}:qwen2.5-coder-1.5b-instruct")
    if kind != "openai":
        check_model_source(model, f"{flag} {kind}:")
    return spec


# --------------------------------------------------------------------------- summary




@dataclass
class GroupStat:
    """Follow-up rate of one (decoding, temperature) group; errors are excluded from ``n``."""

    decoding: str
    temperature: float
    n: int
    n_errors: int
    n_genuine: int
    rate: float
    ci_low: float
    ci_high: float
    label_counts: dict[str, int]


@dataclass
class JudgeSummary:
    """What one ``judge_run`` produced; ``table()`` is the markdown the CLI prints."""

    run_dir: str
    judge: str
    labels_path: str
    n_records: int
    n_labelled: int
    n_errors: int
    n_new: int
    n_skipped: int
    n_unlabelled: int
    label_counts: dict[str, int]
    groups: list[GroupStat] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        lines = [f"judge `{self.judge}`: {self.n_labelled} labelled, {self.n_errors} judge errors, "
                 f"{self.n_unlabelled} not labelled, of {self.n_records} user turns "
                 f"({self.n_new} judged now, {self.n_skipped} already labelled)", "",
                 "| decoding | T | n | follow-up rate | 95% CI (Wilson) | judge errors |",
                 "|---|---|---|---|---|---|"]
        for g in self.groups:
            rate = f"{g.rate:.1%}" if g.n else "—"
            ci = f"[{g.ci_low:.1%}, {g.ci_high:.1%}]" if g.n else "—"
            lines.append(f"| {g.decoding} | {g.temperature:g} | {g.n} | {rate} | {ci} | {g.n_errors} |")
        heads = [f"{g.decoding} T={g.temperature:g}" for g in self.groups]
        lines += ["", "| label | " + " | ".join(heads + ["all"]) + " |",
                  "|---|" + "---|" * (len(heads) + 1)]
        total = sum(self.label_counts.values())
        for lab in LABELS:
            cells = [f"{g.label_counts.get(lab, 0)}" for g in self.groups]
            c = self.label_counts.get(lab, 0)
            cells.append(f"{c} ({c / total:.1%})" if total else "0")
            lines.append(f"| {lab} | " + " | ".join(cells) + " |")
        if self.errors:
            lines += ["", "judge errors by reason: "
                      + "; ".join(f"{r} ×{c}" for r, c in sorted(self.errors.items(), key=lambda kv: -kv[1]))]
        return "\n".join(lines)


def _error_kind(err: str | None) -> str:
    return (err or "unknown").split(":", 1)[0][:60]


def summarize_labels(inputs: Sequence[JudgeInput], label_rows: Iterable[dict[str, Any]], *, run_dir: str = "",
                     judge: str = "", labels_path: str = "", n_new: int = 0, n_skipped: int = 0,
                     seconds: float = 0.0) -> JudgeSummary:
    """Follow-up rate with Wilson 95% CI per (decoding, temperature) and the label distribution."""
    by_id = {r["record_id"]: r for r in label_rows}
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    unlabelled = 0
    for inp in inputs:
        row = by_id.get(inp.record_id)
        if row is None:
            unlabelled += 1
            continue
        groups.setdefault((inp.decoding, inp.temperature), []).append(row)
    stats = []
    all_counts: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for (dec, temp), rows in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ok = [r for r in rows if r["label"] != JUDGE_ERROR]
        errs = [r for r in rows if r["label"] == JUDGE_ERROR]
        errors.update(_error_kind(r.get("error")) for r in errs)
        counts = Counter(r["label"] for r in ok)
        all_counts.update(counts)
        k = counts.get(GENUINE, 0)
        lo, hi = wilson(k, len(ok))
        stats.append(GroupStat(decoding=dec, temperature=temp, n=len(ok), n_errors=len(errs), n_genuine=k,
                               rate=k / len(ok) if ok else float("nan"), ci_low=lo, ci_high=hi,
                               label_counts=dict(counts)))
    return JudgeSummary(run_dir=str(run_dir), judge=judge, labels_path=str(labels_path), n_records=len(inputs),
                        n_labelled=sum(all_counts.values()), n_errors=sum(errors.values()), n_new=n_new,
                        n_skipped=n_skipped, n_unlabelled=unlabelled, label_counts=dict(all_counts),
                        groups=stats, errors=dict(errors), seconds=round(seconds, 2))


# --------------------------------------------------------------------------- the stage


def _drop_error_rows(path: Path) -> int:
    """Rewrite ``path`` without ``judge_error`` rows (atomically), so they are retried; return how many."""
    rows = read_jsonl(path)
    keep = [r for r in rows if r.get("label") != JUDGE_ERROR]
    if len(keep) == len(rows):
        return 0
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in keep:
            f.write(dumps_row(r) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(rows) - len(keep)


def _safe_base_url(url: str | None) -> str | None:
    """Scheme, host and path only: a URL may carry credentials (``https://user:pass@host``)."""
    if not url:
        return None
    s = urlsplit(url)
    host = s.hostname or ""
    port = f":{s.port}" if s.port else ""
    return f"{s.scheme}://{host}{port}{s.path}"


def _stem(labels_file: str) -> str:
    name = Path(labels_file).name
    return name[: -len(".jsonl")] if name.endswith(".jsonl") else name


def _check_counts(limit: int | None, opts: dict[str, Any]) -> None:
    """Refuse negative or zero counts up front: ``limit=-1`` would silently judge all rows but one."""
    bad = []
    if limit is not None and limit < 0:
        bad.append(f"limit must be >= 0, got {limit}")
    for name, lo in (("concurrency", 1), ("max_retries", 0)):
        if opts.get(name) is not None and opts[name] < lo:
            bad.append(f"{name} must be >= {lo}, got {opts[name]}")
    if opts.get("timeout") is not None and not opts["timeout"] > 0:
        bad.append(f"timeout must be > 0 seconds, got {opts['timeout']}")
    if bad:
        from .errors import UserError

        raise UserError("invalid judge options: " + "; ".join(bad))


def _check_labels_file(run_dir: str | Path, labels_file: str) -> None:
    """The labels file (and its summary and manifest beside it) must live inside the run directory: a
    ``--labels ../x.jsonl`` would write outside it, where no later stage looks."""
    run = Path(run_dir).resolve()
    target = (run / labels_file).resolve()
    if Path(labels_file).is_absolute() or target.parent != run and run not in target.parents:
        raise UsageError(f"--labels {labels_file} points outside the run directory {run_dir}: pass a file name "
                         f"inside it (e.g. labels_other.jsonl)")


def judge_run(run_dir: str | Path, judge: str | Judge | None = "offline", *, labels_file: str = LABELS_FILE,
              retry_errors: bool = True, limit: int | None = None, progress: bool = True,
              **opts: Any) -> JudgeSummary:
    """Label the user turns of ``run_dir`` (see :func:`_judge_run`) holding the labels file's writer lock:
    a second judge process on the same file is refused instead of appending duplicate rows."""
    _check_counts(limit, opts)
    _check_labels_file(run_dir, labels_file)
    kw = dict(labels_file=labels_file, retry_errors=retry_errors, limit=limit, progress=progress, **opts)
    if not Path(run_dir).is_dir():
        return _judge_run(run_dir, judge, **kw)  # raises the stage's own "no such run" error
    with writer_lock(Path(run_dir) / labels_file):
        return _judge_run(run_dir, judge, **kw)


def _judge_run(run_dir: str | Path, judge: str | Judge | None = "offline", *, labels_file: str = LABELS_FILE,
               retry_errors: bool = True, limit: int | None = None, progress: bool = True,
               **opts: Any) -> JudgeSummary:
    """Label the user turns of ``run_dir`` into ``run_dir/labels_file`` and summarise.

    ``judge`` is a spec for :func:`make_judge` (``"offline"``, ``"openai:MODEL"``; ``None`` picks by
    environment) or a ready :class:`Judge`. Rows already labelled are skipped; ``judge_error`` rows are
    dropped first and retried unless ``retry_errors=False``. ``limit`` caps how many *new* rows are
    judged (for a quick look). Writes ``<stem>_summary.md`` and ``<stem>_manifest.json`` next to the
    labels (never the API key).
    """
    t0 = time.time()
    run_dir = Path(run_dir)
    inputs = inputs_from_run(run_dir)
    j = make_judge(judge, **opts) if judge is None or isinstance(judge, str) else judge
    path = run_dir / labels_file
    existing = read_jsonl(path)
    other = sorted({r.get("judge", "?") for r in existing} - {j.name})
    if other:
        raise JudgeMismatch(
            f"{path} holds labels from {other}, not from {j.name!r}; one labels file holds one judge. "
            f"Write this judge elsewhere (--labels labels_{re.split(r'[:@+-]', j.name)[0]}.jsonl) "
            f"or delete {path} to relabel")
    if retry_errors and path.exists():
        _drop_error_rows(path)
    store = JsonlStore(path, key="record_id")
    todo = [inp for inp in inputs if not store.has(inp.record_id)]
    n_skipped = len(inputs) - len(todo)
    if limit is not None:
        todo = todo[:limit]
    n_new = 0
    if todo:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc=f"judge {j.name}", unit="turn", disable=not progress)
        try:
            for rec in j.label_many(todo):
                store.append(rec.to_dict())
                n_new += 1
                bar.update(1)
        finally:
            bar.close()
    summary = summarize_labels(inputs, read_jsonl(path, key="record_id"), run_dir=str(run_dir), judge=j.name,
                               labels_path=str(path), n_new=n_new, n_skipped=n_skipped, seconds=time.time() - t0)
    stem = _stem(labels_file)
    (run_dir / f"{stem}_summary.md").write_text(summary.table() + "\n", encoding="utf-8")
    # Cumulative judging time over commands that judged rows (a resumed or reused run adds, not overwrites):
    # the propensity probe's cost comparison reads seconds per judged turn from it.
    man_path = run_dir / f"{stem}_manifest.json"
    old_man = read_json(man_path) if man_path.exists() else {}
    timing = dict(old_man.get("timing", {})) if old_man.get("judge") == j.name else {}
    if n_new:
        timing = {"seconds": round(timing.get("seconds", 0.0) + time.time() - t0, 3),
                  "rows": int(timing.get("rows", 0)) + n_new}
    manifest = {"stage": "judge", "judge": j.name, "labels_file": labels_file, "taxonomy": TAXONOMY_VERSION,
                "summary": {k: v for k, v in summary.to_dict().items() if k != "groups"},
                "judge_config": getattr(j, "public_config", lambda: {})(), "versions": versions(), "timing": timing}
    write_json(man_path, manifest)
    return summary


# --------------------------------------------------------------------------- CLI


def add_judge_args(p: argparse.ArgumentParser) -> None:
    """Arguments of ``mechprobe judge`` (the CLI module calls this and :func:`run_judge_cli`)."""
    p.add_argument("run_dir", help="probe run directory (holds user_turns.jsonl and assistant.jsonl)")
    p.add_argument("--judge", default=None,
                   help="offline | offline-lexical | openai:MODEL | local:MODEL | hybrid:MODEL | hybrid2:MODEL (default: openai:$MECHPROBE_JUDGE_MODEL "
                        "if set, else offline)")
    p.add_argument("--base-url", default=None,
                   help="OpenAI-compatible endpoint (default: $OPENAI_BASE_URL, else api.openai.com)")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY",
                   help="name of the environment variable holding the API key (keys never go on the "
                        "command line, where shell history and `ps` would keep them)")
    p.add_argument("--concurrency", type=int, default=None, help="parallel requests (LLM judge; default 4)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per request (LLM judge; default 60)")
    p.add_argument("--max-retries", type=int, default=None, help="retries on 429/5xx/timeouts (default 5)")
    p.add_argument("--cache-dir", default=None,
                   help="LLM judge cache (default: $MECHPROBE_CACHE/judge or ~/.cache/mechprobe/judge)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the LLM judge cache")
    p.add_argument("--labels", default=LABELS_FILE, help="labels file name inside RUN_DIR")
    p.add_argument("--limit", type=int, default=None, help="judge at most N new rows")
    p.add_argument("--keep-errors", action="store_true", help="do not retry earlier judge_error rows")
    p.add_argument("--no-progress", action="store_true")


def run_judge_cli(a: argparse.Namespace) -> int:
    """Run the stage from parsed arguments and print the summary table."""
    spec = resolve_judge_spec(a.judge)
    opts: dict[str, Any] = {}
    if spec.startswith("openai:"):
        opts = {"base_url": a.base_url, "concurrency": a.concurrency, "timeout": a.timeout,
                "max_retries": a.max_retries, "api_key": os.environ.get(a.api_key_env) or None}
        opts["cache_dir"] = False if a.no_cache else a.cache_dir
    elif spec.startswith(("local:", "hybrid:", "hybrid2:")):
        opts = {"cache_dir": False if a.no_cache else a.cache_dir}
    try:
        s = judge_run(a.run_dir, spec, labels_file=a.labels, retry_errors=not a.keep_errors, limit=a.limit,
                      progress=not a.no_progress, **opts)
    except UserError as e:  # configuration errors with a fix (JudgeMismatch, JudgeFatal, ModelLoadError): one line
        print(f"mechprobe judge: error: {e}", file=sys.stderr)
        return 2
    print(s.table())
    if s.n_errors and not s.n_labelled:
        print(f"mechprobe judge: error: every judged turn ({s.n_errors}) is a judge error "
              f"({'; '.join(f'{r} x{c}' for r, c in s.errors.items())}); nothing usable was labelled. Check the "
              f"endpoint, key and model; re-running retries the error rows", file=sys.stderr)
        return 2  # a problem the user fixes (endpoint, key, model), like every UserError
    return 0


def main_judge(argv: list[str] | None = None) -> int:
    """``mechprobe judge RUN_DIR [--judge openai:MODEL | --judge offline] ...``"""
    p = argparse.ArgumentParser(prog="mechprobe judge", description="Label the user turns of a probe run.")
    add_judge_args(p)
    return run_judge_cli(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main_judge())
