"""Two implementations timed in the same rounds: their ratio, and whether the run can decide a target.

Each round times every implementation of a case back to back, so round ``i`` of one against round
``i`` of the other is a fair pair: load from elsewhere on a shared machine moves between rounds, and
falls on both members of a pair alike. The ratio reported is the median of the pairs' ratios, and
beside it an interval that holds the median of their distribution with 90 % confidence, whatever
that distribution is: the k-th smallest and the k-th largest pair, with k from the binomial
distribution (the sign test's interval; it needs at least 5 rounds).

A target is met when the whole interval satisfies it, missed when none of it does, and undecided
when the interval straddles it: then this machine's noise cannot tell, and more rounds (or a quieter
machine) can. One median decided these targets before, and a rerun the same hour often decided the
other way (issues 16 and 17 recorded 0.91-1.13x for one ratio over six runs). The interval holds
the noise between the rounds of one run, not a shift of the whole machine between runs: two runs
of one pipeline schedule an hour apart gave 1.02-1.09 and 1.09-1.16, so a second run checks a first.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

CONFIDENCE = 0.90
# how a table's caption says what its ratios' brackets hold
INTERVAL = (
    "the median of the rounds' paired ratios with its 90 % interval in brackets, *undecided* "
    "where the interval straddles the target"
)


def median_interval(
    values: list[float], confidence: float = CONFIDENCE
) -> tuple[float, float] | None:
    """``(k-th smallest, k-th largest)`` of ``values``: the median of the distribution they were drawn
    from lies outside with probability at most ``1 - confidence``. None below 5 values at 90 %."""
    x, n = sorted(values), len(values)
    # outside: P(the median lies below the (k+1)-th smallest or above its mirror)
    k, outside = 0, 0.0
    while k < n // 2:
        outside += 2 * math.comb(n, k) / 2**n
        if outside > 1 - confidence:
            break
        k += 1
    return (x[k - 1], x[n - k]) if k else None


@dataclass(frozen=True)
class Ratio:
    """``a``'s time / ``b``'s over the rounds that timed both."""

    median: float
    interval: tuple[float, float] | None  # None: too few rounds, the median alone decides

    @classmethod
    def of(cls, a: dict, b: dict, rounds: str = "rounds_ms", median: str = "step_ms") -> Ratio:
        """From two implementations' results in one case: their per-round times under ``rounds``;
        without rounds, the ratio of their ``median`` times."""
        pairs = [x / y for x, y in zip(a.get(rounds, ()), b.get(rounds, ()), strict=True)]
        if not pairs:
            return cls(a[median] / b[median], None)
        return cls(statistics.median(pairs), median_interval(pairs))

    def at_most(self, target: float) -> bool | None:
        lo, hi = self.interval or (self.median, self.median)
        return True if hi <= target else False if lo > target else None

    def at_least(self, target: float) -> bool | None:
        lo, hi = self.interval or (self.median, self.median)
        return True if lo >= target else False if hi < target else None

    @property
    def cell(self) -> str:
        """``1.03x (0.98-1.07)``: the median and, where there is one, its interval."""
        if self.interval is None:
            return f"{self.median:.2f}x"
        lo, hi = self.interval
        return f"{self.median:.2f}x ({lo:.2f}-{hi:.2f})"


def compare(rows: list[dict[str, float]], a: str, b: str) -> tuple[Ratio, dict[str, float]]:
    """``a``'s time over ``b``'s, paired per round (``rows``: one ``{name: ms}`` a round), and each
    one's median over the rounds."""
    ratio = Ratio.of({"rounds_ms": [r[a] for r in rows]}, {"rounds_ms": [r[b] for r in rows]})
    return ratio, {k: statistics.median(r[k] for r in rows) for k in (a, b)}


def step_and_cpu(a: dict, b: dict) -> tuple[Ratio, Ratio]:
    """``a``'s step time and CPU time per step against ``b``'s, over the same rounds."""
    return Ratio.of(a, b), Ratio.of(a, b, "rounds_cpu_ms", "cpu_ms")


def all_of(*verdicts: bool | None) -> bool | None:
    """Met when every verdict is, missed when any is, else undecided."""
    if any(v is False for v in verdicts):
        return False
    return True if all(v is True for v in verdicts) else None


def mark(met: bool | None) -> str:
    return "undecided" if met is None else ("yes" if met else "**no**")
