"""Task scorers for the assistant turn: exact match on the final number (GSM8K), boxed answers (MATH).

The paper's contrast is *task accuracy scales, follow-up does not*, so the assistant turn is scored
with the conventional rules of each benchmark:

* GSM8K: the gold is the number after ``####``; the prediction is the number in ``#### N`` or
  ``\\boxed{N}`` if present, else the *last* number in the response (the usual lm-eval "flexible
  extract"). Commas, ``$`` and trailing zeros after a decimal point are normalised away.
* MATH-500: the last ``\\boxed{...}`` (balanced braces), normalised (spaces, ``\\left``/``\\right``,
  ``\\!``, ``dfrac``/``tfrac``, ``^\\circ``, ``\\text{}`` units, a leading ``x=``), compared as strings
  and numerically when both parse.
* IFEval: unscored (None). Its verifiable-instruction checker lives in ``lm-eval``, which pulls
  langdetect/nltk data downloads at run time; rather than a partial re-implementation, the prompts
  are probed and the instruction ids kept in the item's meta.
"""

from __future__ import annotations

import re
from typing import Any

_NUM = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def _norm_number(s: str) -> str | None:
    s = s.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        v = float(s)
    except ValueError:
        return None
    if v == int(v) and abs(v) < 1e15:
        return str(int(v))
    return repr(v)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), with nested braces balanced."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    i = text.find("{", idx)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1: j]
    return None


def extract_gsm8k(response: str) -> str | None:
    m = re.findall(r"####\s*(" + _NUM.pattern + ")", response)
    if m:
        return _norm_number(m[-1])
    boxed = last_boxed(response)
    if boxed is not None:
        nums = _NUM.findall(boxed)
        if nums:
            return _norm_number(nums[-1])
    nums = _NUM.findall(response)
    return _norm_number(nums[-1]) if nums else None


def normalize_math(s: str) -> str:
    s = s.strip()
    s = re.sub(r"\\text\{\s*([^}]*)\}", r"\1", s)
    for a, b in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("dfrac", "frac"),
                 ("tfrac", "frac"), ("^\\circ", ""), ("^{\\circ}", ""), ("\\$", ""), ("$", ""), ("\\%", ""),
                 ("%", "")):
        s = s.replace(a, b)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"^[a-zA-Z]\s*=", "", s)
    s = re.sub(r"(degrees?|units?|cm|inches|meters)$", "", s)
    s = s.rstrip(".")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    return s


def _as_float(s: str) -> float | None:
    m = re.fullmatch(r"\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    if m and int(m.group(2)) != 0:
        return int(m.group(1)) / int(m.group(2))
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def score(dataset: str, response: str, gold: str | None, meta: dict[str, Any] | None = None
          ) -> tuple[float | None, str | None]:
    """(score, extracted): 1.0/0.0 where the task has a verifiable answer, (None, None) otherwise."""
    meta = meta or {}
    kind = meta.get("scorer", dataset)
    if gold is None:
        return None, None
    if kind == "gsm8k":
        pred = extract_gsm8k(response)
        g = _norm_number(gold)
        return (1.0 if pred is not None and pred == g else 0.0), pred
    if kind == "math500":
        boxed = last_boxed(response)
        if boxed is None:
            return 0.0, None
        p, g = normalize_math(boxed), normalize_math(gold)
        if p == g:
            return 1.0, boxed
        fp, fg = _as_float(p), _as_float(g)
        ok = fp is not None and fg is not None and abs(fp - fg) <= 1e-6 * max(1.0, abs(fg))
        return (1.0 if ok else 0.0), boxed
    return None, None
