"""Task scorers for the assistant turn: the project contrasts task accuracy with follow-up rate, so the
assistant turn is scored by each benchmark's conventional rule. ``score`` returns ``(score, extracted)``:
1.0/0.0 with what was read from the response, or ``(None, None)`` when the item is unscored.

**GSM8K** (and ``builtin`` items with a gold, or ``meta["scorer"] == "gsm8k"``). Gold: the number after
the last ``####`` of the solution, commas removed. Prediction, the first rule that finds a number:

1. the last ``#### N`` in the response (the dataset's own format);
2. the last number inside the last ``\\boxed{...}``;
3. the last "answer is N" / "answer: N" phrase, unless N is followed by an operator
   (``answer is 5 + 3 = 8`` falls through to rule 4);
4. the last number in the response (lm-eval's "flexible extract" convention). Its known cost: an
   answer followed by other numbers ("18 eggs, 2 of them ...") reads the later number.

A number is an optional ``-`` and ``$``, digits with optional thousands commas (``1,234``; ``1,2`` is two
numbers) and an optional decimal part; a ``-`` glued to a preceding word or digit (``10-18``) is a range
dash, not a sign. Both sides are compared as exact decimals after dropping ``$``, commas and trailing
zeros: ``$1,234.00`` equals ``1234``, ``18.5`` does not equal ``18``.

**MATH-500**. The content of the last ``\\boxed{...}`` (balanced braces; also ``\\fbox`` and
``\\boxed 5``) is normalised (:func:`normalize_math`) and compared with the normalised gold as strings,
then numerically when both read as numbers (``0.5`` = ``\\frac12``). No box: 0.0.

**IFEval** (and items with ``meta["scorer"] == "ifeval"``). Prompt-level *strict* accuracy (1.0 when every
instruction is followed) from the verifiable-instruction checkers of the PyPI package ``if-verifiable``
(optional extra ``mechprobe[ifeval]``: a port of Google's checkers packaged on their own, Apache-2.0, young
and single-maintainer, so it stays optional). ``lm-eval`` has the same checkers but pulls a whole
evaluation harness and downloads nltk data at import. Without the package, or for the ~12% of IFEval
prompts whose checker needs nltk's ``punkt_tab`` data (sentence counts; a download,
``python -m nltk.downloader punkt_tab``, impossible offline), the item is unscored: ``(None, None)`` and
one warning, never a guessed score.

Everything else (MT-Bench, HH-RLHF, Topical-Chat, open builtin prompts): ``(None, None)``.
"""

from __future__ import annotations

import logging
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

log = logging.getLogger(__name__)

_NUMBER = r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUM_RE = re.compile(rf"(?<![\w.]){_NUMBER}(?!\d)")
_HASHES_RE = re.compile(rf"####\s*\**\s*({_NUMBER})(?!\d)")
_ANSWER_RE = re.compile(rf"answer(?:\s+is)?\s*[:=]?\s*\**\s*({_NUMBER})(?!\d|[,.]\d)(?!\s*[-+*/×÷=^])",
                        re.IGNORECASE)


def normalize_number(s: str) -> str | None:
    """Canonical text of a number (``"$1,234.00"`` -> ``"1234"``, ``"-0.50"`` -> ``"-0.5"``), or None."""
    s = s.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        d = Decimal(s)
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (nested braces balanced), or of a bare
    ``\\boxed 5`` (up to the next ``$`` or whitespace). None when there is none or it is unclosed."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    rest = text[idx + (6 if text.startswith("\\boxed", idx) else 5):]
    if rest.startswith(" ") and not rest.lstrip().startswith("{"):
        m = re.match(r"\s+([^\s$]+)", rest)
        return m.group(1) if m else None
    i = rest.find("{")
    if i < 0 or rest[:i].strip():
        return None
    depth = 0
    for j in range(i, len(rest)):
        if rest[j] == "{":
            depth += 1
        elif rest[j] == "}":
            depth -= 1
            if depth == 0:
                return rest[i + 1: j]
    return None


def extract_gsm8k(response: str) -> str | None:
    """The predicted final number of a GSM8K-style response, normalised (rules in the module doc)."""
    hashes = _HASHES_RE.findall(response)
    if hashes:
        return normalize_number(hashes[-1])
    boxed = last_boxed(response)
    if boxed is not None:
        nums = _NUM_RE.findall(boxed)
        if nums:
            return normalize_number(nums[-1])
    phrases = _ANSWER_RE.findall(response)
    if phrases:
        return normalize_number(phrases[-1])
    nums = _NUM_RE.findall(response)
    return normalize_number(nums[-1]) if nums else None


# ---------------------------------------------------------------------------------------------------
# MATH answers

_UNIT_WORDS = ("degrees", "degree", "units", "unit", "cents", "cent", "dollars", "dollar", "inches", "inch",
               "feet", "foot", "meters", "meter", "cm", "mm", "km", "hours", "hour", "minutes", "minute",
               "seconds", "second", "days", "day")


def _fix_fracs(s: str) -> str:
    r"""Brace the arguments of ``\frac`` written without them: ``\frac12`` and ``\frac{270}7`` ->
    ``\frac{1}{2}``, ``\frac{270}{7}``."""
    out = []
    i = 0
    while True:
        j = s.find("\\frac", i)
        if j < 0:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i: j + 5])
        k = j + 5
        for _ in range(2):
            if k < len(s) and s[k] == "{":
                depth = 0
                for m in range(k, len(s)):
                    depth += {"{": 1, "}": -1}.get(s[m], 0)
                    if depth == 0:
                        break
                out.append(s[k: m + 1])
                k = m + 1
            elif k < len(s) and s[k] != "\\":
                out.append("{" + s[k] + "}")
                k += 1
        i = k


def normalize_math(s: str) -> str:
    r"""Canonical text of a MATH answer, so equal answers written differently compare equal.

    Drops spacing commands and spaces, ``\left``/``\right``, ``\displaystyle``, ``$``, ``\%``,
    degree marks, trailing units (``5.4 \text{ cents}``, ``10 cm``), a trailing period, a leading
    ``x=`` (single-letter variable, single ``=``); ``dfrac``/``tfrac`` -> ``frac``; braces
    ``\frac12``, ``\sqrt2``; unwraps a remaining ``\text{...}``; ``(C)`` -> ``C``; ``.5`` -> ``0.5``.
    """
    s = s.strip().replace("\n", "")
    for a in ("\\!", "\\,", "\\;", "\\:", "\\ ", "\\left", "\\right", "\\displaystyle", "\\$", "$",
              "\\%", "%", "^{\\circ}", "^\\circ", "\\degree"):
        s = s.replace(a, "")
    s = s.replace("dfrac", "frac").replace("tfrac", "frac").replace("\\mbox", "\\text")
    # A \text{...} after something else is a unit ("5.4 \text{ cents}", "10\text{ cm}^2"): drop it.
    s = re.sub(r"(?<=\S)\s*\\text\{[^{}]*\}(\^\{?\d\}?)?\s*$", "", s)
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\s+", "", s)
    s = re.sub(rf"(?<=[\d}}])(?:{'|'.join(_UNIT_WORDS)})(\^\{{?\d\}}?)?$", "", s)
    s = s.rstrip(".")
    if s.count("=") == 1 and re.match(r"^[a-zA-Z]=", s):
        s = s[2:]
    s = _fix_fracs(s)
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = re.sub(r"^\(([A-Ea-e])\)$", r"\1", s)
    s = re.sub(r"(^|[^\d])\.(\d)", r"\g<1>0.\2", s)
    return s


def _math_number(s: str) -> Fraction | None:
    r"""The value of a normalised answer that is a plain number, ``a/b`` or ``\frac{a}{b}`` (optionally
    negated); None otherwise (tuples, intervals, expressions stay string-compared)."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s) or re.fullmatch(r"(-?)(-?\d+)/(-?\d+)", s)
    if m:
        num, den = int(m.group(2)), int(m.group(3))
        if den == 0:
            return None
        v = Fraction(num, den)
        return -v if m.group(1) else v
    if re.fullmatch(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?", s):
        return Fraction(Decimal(s.replace(",", "")))
    return None


def math_equal(pred: str, gold: str) -> bool:
    """Whether two MATH answers agree after normalisation (as text, else as numbers)."""
    p, g = normalize_math(pred), normalize_math(gold)
    if p == g:
        return True
    fp, fg = _math_number(p), _math_number(g)
    return fp is not None and fg is not None and abs(fp - fg) <= Fraction(1, 10**6) * max(1, abs(fg))


# ---------------------------------------------------------------------------------------------------
# IFEval

_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


def score_ifeval(response: str, meta: dict[str, Any]) -> tuple[float | None, str | None]:
    """Prompt-level strict IFEval score via ``if-verifiable``; ``extracted`` is ``"k/n strict"``."""
    ids, kwargs = meta.get("instruction_id_list"), meta.get("kwargs")
    if not ids:
        return None, None
    try:
        from if_verifiable.common import evaluate_instructions  # lazy: extra [ifeval]
        from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT  # lazy: extra [ifeval]
    except ImportError:
        _warn_once("IFEval items are unscored: pip install 'mechprobe[ifeval]' (if-verifiable) to check them")
        return None, None
    if not response.strip():  # the checkers' convention: an empty response follows no instruction
        return 0.0, f"0/{len(ids)} strict"
    try:
        results, scores = evaluate_instructions(response, list(ids), list(kwargs or [{}] * len(ids)),
                                                meta.get("prompt", ""), INSTRUCTION_DICT)
    except LookupError as e:  # nltk data (punkt_tab) that only a download provides
        m = re.search(r"Resource\s+\S+\s+not found", str(e))
        _warn_once(f"IFEval: some instruction checkers need nltk data that is not installed ("
                   f"{m.group(0) if m else type(e).__name__}); those items are unscored")
        return None, None
    except Exception as e:  # a checker bug must not end a long generation run
        log.warning("IFEval checker failed on %s: %s: %s", ids, type(e).__name__, e)
        return None, None
    if not results:  # every instruction id unknown to the checker
        return None, None
    passed = sum(r.strict_pass for r in results)
    return float(scores.binary_strict), f"{passed}/{len(results)} strict"


# ---------------------------------------------------------------------------------------------------


def score(dataset: str, response: str, gold: str | None, meta: dict[str, Any] | None = None
          ) -> tuple[float | None, str | None]:
    """``(score, extracted)`` of one assistant response; ``(None, None)`` when the item is unscored.

    ``meta["scorer"]`` overrides the dataset's scorer (``builtin`` arithmetic items say ``gsm8k``; a
    ``builtin`` item with a gold and no scorer is scored like GSM8K too).
    """
    meta = meta or {}
    kind = meta.get("scorer") or ("gsm8k" if dataset == "builtin" and gold is not None else dataset)
    if kind == "ifeval":
        return score_ifeval(response, meta)
    if gold is None:
        return None, None
    if kind == "gsm8k":
        pred = extract_gsm8k(response)
        g = normalize_number(gold)
        ok = pred is not None and (pred == g if g is not None else pred == gold.strip())
        return (1.0 if ok else 0.0), pred
    if kind == "math500":
        boxed = last_boxed(response)
        if boxed is None:
            return 0.0, None
        return (1.0 if math_equal(boxed, gold) else 0.0), boxed
    return None, None
