"""Check the numbers a markdown file quotes against the recomputed findings.

The rule, kept simple so a writer can see what is checked:

- Only lines between ``<!-- findings:begin -->`` and ``<!-- findings:end -->`` are read (several blocks may be
  in a file; a file without one fails, since a check that reads nothing would pass anything).
- Inline code (```...```), link targets (``](...)``) and HTML comments are not read: put a setting that is not a
  finding there (`alpha 0.8`, `residual 18`).
- Quoted numbers are: an interval ``[a, b]`` (both ends, as one pair), a fraction ``k/n`` of whole numbers, a
  percentage ``x%`` (in ``a–b%`` both ends are percentages), and any other number with a decimal point (a kappa,
  a rate in points). Whole numbers without ``%`` (counts, items, steps) are not checked; nor are numbers glued to
  letters (``Qwen2.5``, ``1.5B``).
- A quoted number matches when some recomputed value equals it at the precision quoted (``6.7%`` matches
  0.0667); a percentage matches rates and differences; a plain decimal or an interval matches a kappa as is or a
  rate in percent; ``k/n`` matches a rate's count or a kappa's agreements. The sign counts (``−`` or ``-``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from mechprobe.errors import UsageError

from .values import PERCENT, Value

__all__ = ["BEGIN", "END", "Quoted", "quoted_numbers", "check_text", "check_file"]

BEGIN, END = "<!-- findings:begin -->", "<!-- findings:end -->"
_NUM = r"[+\-−]?\d+(?:\.\d+)?"
_EDGE_L, _EDGE_R = r"(?<![\w.])", r"(?![\w]|\.\d)"
_INTERVAL = re.compile(rf"\[\s*({_NUM})\s*(%?)\s*,\s*({_NUM})\s*(%?)\s*\]")
_FRACTION = re.compile(r"(?<![\w./])(\d+)/(\d+)(?![\w/]|\.\d)")
_RANGE_PCT = re.compile(rf"{_EDGE_L}({_NUM})\s*[–-]\s*({_NUM})%")
_PERCENT = re.compile(rf"{_EDGE_L}({_NUM})%")
_DECIMAL = re.compile(rf"{_EDGE_L}([+\-−]?\d+\.\d+){_EDGE_R}")
_HIDDEN = re.compile(r"`[^`]*`|\]\([^)]*\)|<!--.*?-->")


@dataclass(frozen=True)
class Quoted:
    """One number quoted in a checked block: where, what (as written), its kind, and whether it matched."""

    path: str
    line: int
    text: str
    kind: str  # "interval" | "fraction" | "percent" | "decimal"
    ok: bool

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind} {self.text} is not among the recomputed findings"


def _blocks(text: str, path: str) -> list[tuple[int, str]]:
    """(line number, line) of every line inside a findings block."""
    out, inside, opened = [], False, 0
    for i, line in enumerate(text.splitlines(), start=1):
        s = line.strip()
        if s == BEGIN:
            if inside:
                raise UsageError(f"{path}:{i}: {BEGIN} inside an open block (opened at line {opened}); close it "
                                 f"with {END} first")
            inside, opened = True, i
        elif s == END:
            if not inside:
                raise UsageError(f"{path}:{i}: {END} without a {BEGIN} before it; add the opening marker")
            inside = False
        elif inside:
            out.append((i, line))
    if inside:
        raise UsageError(f"{path}:{opened}: {BEGIN} is never closed; add {END} after the block")
    return out


def _num(s: str) -> float:
    return float(s.replace("−", "-"))


def _decimals(s: str) -> int:
    return len(s.split(".")[1]) if "." in s else 0


def quoted_numbers(line: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """The numbers one line quotes: ``(kind, as written, parts)``; parts are the number strings (two for an
    interval or a fraction), a percentage's with a trailing ``%``."""
    s = _HIDDEN.sub(lambda m: " " * len(m.group(0)), line)
    found: list[tuple[str, str, tuple[str, ...]]] = []

    def take(rx: re.Pattern[str], kind: str, parts: object) -> None:
        nonlocal s
        for m in rx.finditer(s):
            found.append((kind, m.group(0).strip(), parts(m)))  # type: ignore[operator]
        s = rx.sub(lambda m: " " * len(m.group(0)), s)

    take(_INTERVAL, "interval", lambda m: (m[1] + m[2], m[3] + m[4]))
    take(_FRACTION, "fraction", lambda m: (m[1], m[2]))
    take(_RANGE_PCT, "percent", lambda m: (m[1] + "%", m[2] + "%"))
    take(_PERCENT, "percent", lambda m: (m[1] + "%",))
    take(_DECIMAL, "decimal", lambda m: (m[1],))
    return found


def _close(x: float | None, q: str) -> bool:
    """``x`` shown at ``q``'s precision is ``q`` (either rounding at an exact half)."""
    if x is None or not math.isfinite(x):
        return False
    return abs(x - _num(q)) <= 0.5 * 10 ** -_decimals(q) + 1e-9


def _scales(v: Value, percent_only: bool) -> list[float]:
    if v.unit == PERCENT:
        return [100.0]
    return [] if percent_only else [1.0]


def _matches(kind: str, parts: tuple[str, ...], values: list[Value]) -> bool:
    if kind == "fraction":
        k, n = int(parts[0]), int(parts[1])
        return any(v.n == n and v.k is not None and float(v.k) == k for v in values)
    pct = any(p.endswith("%") for p in parts)
    qs = [p.rstrip("%") for p in parts]
    for v in values:
        for scale in _scales(v, pct):
            if kind == "interval":
                if v.has_interval() and _close(scale * v.lo, qs[0]) and _close(scale * v.hi, qs[1]):  # type: ignore[operator]
                    return True
            elif all(_close(scale * v.point, q) for q in qs[:1]):
                return True
    return False


def check_text(text: str, values: dict[str, Value], path: str = "<text>") -> list[Quoted]:
    """Every number quoted inside the findings blocks of ``text``, each marked matched or not.

    Raises:
        UsageError: a block opened and not closed (or closed and not opened).
    Example:
        >>> [q.ok for q in check_text(f"{BEGIN}\\nrate 5.0% [1.7, 13.7]\\n{END}\\n", values)]
    """
    vals = list(values.values())
    out = []
    for i, line in _blocks(text, path):
        for kind, written, parts in quoted_numbers(line):
            if kind == "percent" and len(parts) == 2:  # a range: each end on its own
                for p in parts:
                    out.append(Quoted(path, i, p, kind, _matches(kind, (p,), vals)))
                continue
            out.append(Quoted(path, i, written, kind, _matches(kind, parts, vals)))
    return out


def check_file(path: str | Path, values: dict[str, Value]) -> tuple[list[Quoted], list[str]]:
    """Check one markdown file; returns every quoted number and the failure lines (empty when all match).

    A file without a findings block is one failure: nothing in it would be checked.
    """
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path} not found; pass a markdown file that quotes findings (README.md, docs/findings.md)")
    text = path.read_text(encoding="utf-8")
    if BEGIN not in text:
        return [], [f"{path}: no findings block ({BEGIN} ... {END}); nothing in it was checked"]
    got = check_text(text, values, str(path))
    return got, [str(q) for q in got if not q.ok]
