"""One quoted number of a finding: a rate, a difference or a kappa, with its interval and where it came from.

Why a type of its own: the findings command prints, writes and checks the same numbers, and a docs check can only
say "this quoted number is not among the recomputed ones" if every number carries the precision-free value
(fraction, not rounded percent) and its unit (a rate is quoted in percent, a kappa as is).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Value", "PERCENT", "RAW", "RECOMPUTED", "READ"]

PERCENT, RAW = "%", ""  # a rate or difference (quoted x 100 with %) / a kappa or other raw number
RECOMPUTED, READ = "recomputed", "read"  # from the labels with the package's statistics / copied from a committed file


@dataclass(frozen=True)
class Value:
    """A finding's number under a stable ``key``.

    ``point``/``lo``/``hi`` are fractions for :data:`PERCENT` values (0.05 is 5.0%); ``k``/``n`` the count behind a
    rate (``k`` may be a half: two labellers' consensus) or a kappa's agreements; ``how`` is :data:`RECOMPUTED` or
    :data:`READ`; ``source`` the committed file(s) it comes from, relative to the repository; ``method`` the
    estimator's own description; ``items`` the items behind it where known (an estimate on fewer than 20 says so
    where it is quoted); ``seed_spread`` how far a bootstrap interval's ends move over five seeds.
    """

    key: str
    point: float
    lo: float | None = None
    hi: float | None = None
    k: float | None = None
    n: int | None = None
    unit: str = PERCENT
    how: str = RECOMPUTED
    source: str = ""
    method: str = ""
    signed: bool = False  # a difference: shown with its sign
    items: int | None = None  # items behind the estimate (fewer than 20: the docs must say so beside it)
    seed_spread: float | None = None  # a bootstrap interval: largest move of an end over five seeds

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def has_interval(self) -> bool:
        return self.lo is not None and self.hi is not None and math.isfinite(self.lo) and math.isfinite(self.hi)

    def text(self) -> str:
        """``3/60 = 5.0% [1.7, 13.7]``, ``+7.5% [-1.3, 17.5]`` or ``0.90 [0.80, 0.98] (116/120 agree)``."""
        if not math.isfinite(self.point):  # undefined (a kappa with one class): its count still says what was seen
            agree = f" ({_count(self.k)}/{self.n} agree)" if self.unit == RAW and self.k is not None and self.n else ""
            return "n/a" + agree
        if self.unit == PERCENT:
            body = f"{100 * self.point:{'+' if self.signed else ''}.1f}%"
            if self.has_interval():
                body += f" [{100 * self.lo:.1f}, {100 * self.hi:.1f}]"  # type: ignore[operator]
            if self.k is not None and self.n:
                body = f"{_count(self.k)}/{self.n} = {body}"
            return body + self._few()
        body = f"{self.point:{'+' if self.signed else ''}.{self._places()}f}"
        if self.has_interval():
            body += f" [{self.lo:.{self._places()}f}, {self.hi:.{self._places()}f}]"
        if self.k is not None and self.n:
            body += f" ({_count(self.k)}/{self.n} agree)"
        return body + self._few()

    def few_items(self) -> bool:
        """Rests on fewer than 20 items."""
        return self.items is not None and self.items < 20

    def _few(self) -> str:
        return f" (n < 20 items: {self.items})" if self.few_items() else ""

    def _places(self) -> int:
        """Two decimals (a kappa, a shift), more for a small p-value so it does not print as 0.00."""
        return 2 if abs(self.point) >= 0.01 or self.point == 0 else 4


def _count(k: float) -> str:
    return str(int(k)) if float(k).is_integer() else f"{k:g}"
