"""Check the numbers a markdown file quotes against the recomputed findings, each against the key it names.

The rule, kept simple so a writer can see what is checked:

- Only lines between ``<!-- findings:begin -->`` and ``<!-- findings:end -->`` are read (several blocks may be
  in a file). A file without a block fails, and so does a block that binds no number: a check that read nothing
  would pass anything.
- Every quoted number is **bound** to one key by a marker a reader does not see rendered, ``<!-- =KEY -->``,
  written after it: a marker binds every quoted number between the previous marker of the block (or the block's
  start) and itself. A number after the block's last marker is unbound and fails; so does a marker that binds no
  number, and a key that ``mechprobe findings`` does not compute.
- Inline code (```...```), link targets (``](...)``) and other HTML comments are not read: put a setting that is
  not a finding there (`alpha 0.8`, `residual 18`).
- Quoted numbers are: an interval ``[a, b]`` (both ends, as one pair), a fraction ``k/n`` (``k`` whole or a half), a
  percentage ``x%`` (in ``a–b%`` each end is its own percentage), and any other number with a decimal point (a
  kappa, a rate in points). Whole numbers without ``%`` (counts, items, steps) are not checked; nor are numbers
  glued to letters (``Qwen2.5``, ``1.5B``).
- A bound number must equal its key's value at the precision quoted (``6.7%`` matches 0.0667): a fraction is the
  key's ``k/n``, a percentage or a plain decimal its point (a rate in percent, a kappa as is), an interval its
  ``[lo, hi]``. The sign counts (``−`` or ``-``). So a swapped number, a stale interval or a "50%" that happens to
  equal some other finding fails. A key on fewer than 20 items needs ``n < 20 items`` in the text it binds.
  ``<!-- =KEY@spread -->`` binds a bootstrap interval's seed spread (points, a plain decimal).
- With ``recomputed_only`` (the README), a key read from a committed summary (``how == "read"``) fails too: the
  README quotes only what is recomputed from per-turn committed files.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from mechprobe.errors import UsageError

from .values import PERCENT, READ, Value

__all__ = ["BEGIN", "END", "MARKER", "SPREAD", "Quoted", "quoted_numbers", "check_text", "check_file", "read_markdown"]

BEGIN, END = "<!-- findings:begin -->", "<!-- findings:end -->"
SPREAD = "@spread"  # KEY@spread: how far KEY's bootstrap interval ends move over five seeds, quoted in points
MARKER = re.compile(r"<!--\s*=\s*([^\s>]+)\s*-->")
_NUM = r"[+\-−]?\d+(?:\.\d+)?"
_EDGE_L, _EDGE_R = r"(?<![\w.])", r"(?![\w]|\.\d)"
_INTERVAL = re.compile(rf"\[\s*({_NUM})\s*(%?)\s*,\s*({_NUM})\s*(%?)\s*\]")
_FRACTION = re.compile(r"(?<![\w./])(\d+(?:\.5)?)/(\d+)(?![\w/]|\.\d)")  # k may be a half: a consensus
_RANGE_PCT = re.compile(rf"{_EDGE_L}({_NUM})\s*[–-]\s*({_NUM})%")
_PERCENT = re.compile(rf"{_EDGE_L}({_NUM})%")
_DECIMAL = re.compile(rf"{_EDGE_L}([+\-−]?\d+\.\d+){_EDGE_R}")
_FEW = re.compile(r"n\s*<\s*20\s+items")
_HIDDEN = re.compile(r"`[^`]*`|\]\([^)]*\)|<!--.*?-->")


@dataclass(frozen=True)
class Quoted:
    """One number quoted in a checked block (or one fault of a block): where, what, its key, whether it matched.

    ``kind`` is ``interval``, ``fraction``, ``percent`` or ``decimal`` for a number, ``block`` or ``marker`` for a
    fault of the block itself; ``why`` says what failed (empty when ``ok``).
    """

    path: str
    line: int
    text: str
    kind: str
    ok: bool
    key: str = ""
    why: str = ""

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind} {self.text}: {self.why or 'ok'}"


def _blocks(text: str, path: str) -> list[list[tuple[int, str]]]:
    """Each findings block as its (line number, line) pairs."""
    out: list[list[tuple[int, str]]] = []
    inside, opened = False, 0
    for i, line in enumerate(text.splitlines(), start=1):
        s = line.strip()
        if s == BEGIN:
            if inside:
                raise UsageError(f"{path}:{i}: {BEGIN} inside an open block (opened at line {opened}); close it "
                                 f"with {END} first")
            inside, opened = True, i
            out.append([])
        elif s == END:
            if not inside:
                raise UsageError(f"{path}:{i}: {END} without a {BEGIN} before it; add the opening marker")
            inside = False
        elif inside:
            out[-1].append((i, line))
    if inside:
        raise UsageError(f"{path}:{opened}: {BEGIN} is never closed; add {END} after the block")
    return out


def _num(s: str) -> float:
    return float(s.replace("−", "-"))


def _decimals(s: str) -> int:
    return len(s.split(".")[1]) if "." in s else 0


def quoted_numbers(line: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """The numbers one line quotes: ``(kind, as written, parts)``; parts are the number strings (two for an
    interval or a fraction), a percentage's with a trailing ``%``. Inline code, link targets and HTML comments
    (markers included) are not read."""
    s = _HIDDEN.sub(lambda m: " " * len(m.group(0)), line)
    found: list[tuple[int, str, str, tuple[str, ...]]] = []

    def take(rx: re.Pattern[str], kind: str, parts: object) -> None:
        nonlocal s
        for m in rx.finditer(s):
            found.append((m.start(), kind, m.group(0).strip(), parts(m)))  # type: ignore[operator]
        s = rx.sub(lambda m: " " * len(m.group(0)), s)

    take(_INTERVAL, "interval", lambda m: (m[1] + m[2], m[3] + m[4]))
    take(_FRACTION, "fraction", lambda m: (m[1], m[2]))
    take(_RANGE_PCT, "percent", lambda m: (m[1] + "%", m[2] + "%"))
    take(_PERCENT, "percent", lambda m: (m[1] + "%",))
    take(_DECIMAL, "decimal", lambda m: (m[1],))
    return [(k, w, p) for _, k, w, p in sorted(found, key=lambda x: x[0])]


def _close(x: float | None, q: str) -> bool:
    """``x`` shown at ``q``'s precision is ``q`` (either rounding at an exact half)."""
    if x is None or not math.isfinite(x):
        return False
    return abs(x - _num(q)) <= 0.5 * 10 ** -_decimals(q) + 1e-9


def _match(kind: str, parts: tuple[str, ...], v: Value) -> str:
    """Why the quoted number is not ``v``'s (empty when it is)."""
    if kind == "fraction":
        k, n = float(parts[0]), int(parts[1])
        if v.n == n and v.k is not None and float(v.k) == k:
            return ""
        return f"is not {v.key}'s count ({v.text()})"
    scale = 100.0 if v.unit == PERCENT else 1.0
    pct = any(p.endswith("%") for p in parts)
    if pct and v.unit != PERCENT:
        return f"is a percentage but {v.key} is not a rate ({v.text()})"
    qs = [p.rstrip("%") for p in parts]
    if kind == "interval":
        if v.has_interval() and _close(scale * v.lo, qs[0]) and _close(scale * v.hi, qs[1]):  # type: ignore[operator]
            return ""
        return f"is not {v.key}'s interval ({v.text()})"
    if _close(scale * v.point, qs[0]):
        return ""
    return f"is not {v.key}'s value ({v.text()})"


def _value_of(key: str, values: dict[str, Value]) -> Value | None:
    """The value a marker names: a key, or ``KEY@spread`` (a bootstrap interval's seed spread, in points)."""
    if key.endswith(SPREAD):
        base = values.get(key[:-len(SPREAD)])
        if base is None or base.seed_spread is None:
            return None
        return Value(key, base.seed_spread, unit=PERCENT, how=base.how, source=base.source)
    return values.get(key)


def check_text(text: str, values: dict[str, Value], path: str = "<text>",
               recomputed_only: bool = False) -> list[Quoted]:
    """Every number quoted inside the findings blocks of ``text``, each checked against the key bound to it, and
    every fault of a block (nothing bound, a marker binding nothing, an unknown key).

    Raises:
        UsageError: a block opened and not closed (or closed and not opened).
    Example:
        >>> [q.ok for q in check_text(f"{BEGIN}\\nrate 5.0% [1.7, 13.7]<!-- =a.rate -->\\n{END}\\n", values)]  # doctest: +SKIP
    """
    out: list[Quoted] = []
    for block in _blocks(text, path):
        pending: list[tuple[int, str, str, tuple[str, ...]]] = []
        said = ""  # the text of the pending segment: an estimate on few items says so in it
        bound = 0
        for i, line in block:
            pos = 0
            for m in [*MARKER.finditer(line), None]:
                chunk = line[pos:m.start()] if m else line[pos:]
                said += " " + chunk
                for kind, written, parts in quoted_numbers(chunk):
                    if kind == "percent" and len(parts) == 2:  # a range: each end on its own
                        pending += [(i, p, kind, (p,)) for p in parts]
                    else:
                        pending.append((i, written, kind, parts))
                if m is None:
                    break
                pos = m.end()
                key = m.group(1)
                v = _value_of(key, values)
                if not pending:
                    out.append(Quoted(path, i, m.group(0), "marker", False, key,
                                      "binds no number; put it right after the number(s) it names"))
                    said = ""
                    continue
                for li, written, kind, parts in pending:
                    if v is None:
                        why = f"its key {key} is not one `mechprobe findings` computes"
                    elif recomputed_only and v.how == READ:
                        why = (f"{key} is read from {v.source}, not recomputed from per-turn committed files; "
                               f"this file quotes recomputed numbers only")
                    else:
                        why = _match(kind, parts, v)
                        if not why and v.few_items() and not _FEW.search(said):
                            why = (f"{key} rests on {v.items} items; say so beside it ('n < 20 items') before "
                                   f"the marker")
                    out.append(Quoted(path, li, written, kind, not why, key, why))
                bound += len(pending)
                pending, said = [], ""
        for li, written, kind, _ in pending:
            out.append(Quoted(path, li, written, kind, False, "",
                              "is bound to no key; add <!-- =KEY --> after it (keys: `mechprobe findings`)"))
        if not bound:
            first = block[0][0] if block else 0
            out.append(Quoted(path, first, "findings block", "block", False, "",
                              "checks no number (every number in it is unbound, in inline code or absent); a check "
                              "that reads nothing fails"))
    return out


def read_markdown(path: str | Path) -> str:
    """A markdown file's text, or a one-line :class:`UsageError` naming it (missing, a folder, not UTF-8)."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "not found"
        raise UsageError(f"{path} {what}; pass a markdown file that quotes findings (README.md, docs/findings.md)")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{path} is not UTF-8 (byte {e.start}: {e.reason}); re-save it as UTF-8") from None


def check_file(path: str | Path, values: dict[str, Value], recomputed_only: bool | None = None
               ) -> tuple[list[Quoted], list[str]]:
    """Check one markdown file; returns every quoted number and the failure lines (empty when all match).

    ``recomputed_only`` defaults to True for a file named ``README.md``: the README quotes only recomputed
    numbers. A file without a findings block is one failure: nothing in it would be checked.
    """
    path = Path(path)
    text = read_markdown(path)
    if recomputed_only is None:
        recomputed_only = path.name == "README.md"
    if BEGIN not in text:
        return [], [f"{path}: no findings block ({BEGIN} ... {END}); nothing in it was checked"]
    got = check_text(text, values, str(path), recomputed_only)
    return [q for q in got if q.kind not in ("block", "marker")], [str(q) for q in got if not q.ok]
