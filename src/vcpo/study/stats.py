"""The study's uncertainty: Student-t intervals of a mean over runs, paired differences between two arms over the
runs they share (same warm start, same seed), and Wilson intervals of collapse counts. Pure functions.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

Z_95 = 1.959964
"""The standard normal 97.5% quantile."""
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""Student's t 97.5% quantiles for 1 to 30 degrees of freedom (the standard table)."""


def t_quantile_975(df: int) -> float:
    """Student's t 97.5% quantile: the table up to 30 degrees of freedom, then the Cornish-Fisher expansion
    ``z + (z^3 + z) / (4 df) + (5 z^5 + 16 z^3 + 3 z) / (96 df^2)`` (within 1e-3 of the exact value there)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(T_975):
        return T_975[df - 1]
    z = Z_95
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class Interval:
    """A point estimate with a 95% interval [low, high] from ``n`` observations (low = high = mean when n = 1)."""

    mean: float
    low: float
    high: float
    n: int

    def excludes_zero(self) -> bool:
        return self.n > 1 and (self.low > 0 or self.high < 0)

    def __str__(self) -> str:
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]" if self.n > 1 else f"{self.mean:.3f} (n=1)"


def t_interval(values: list[float]) -> Interval:
    """The mean of ``values`` and its 95% Student-t interval, mean +- t(n-1) * s / sqrt(n) with s the sample
    standard deviation; it treats the values as independent draws (runs of different seeds)."""
    if not values:
        raise ValueError("t_interval of no values")
    mean = statistics.fmean(values)
    if len(values) == 1:
        return Interval(mean, mean, mean, 1)
    half = t_quantile_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return Interval(mean, mean - half, mean + half, len(values))


def paired_difference(a: dict[object, float], b: dict[object, float]) -> Interval | None:
    """The t interval of ``a[key] - b[key]`` over the keys both have (e.g. (warm start, seed): two arms from the
    same warm start with the same seed share the problem stream and the held-out set, so their difference
    cancels both); None when they share no key."""
    shared = sorted(set(a) & set(b), key=str)
    return t_interval([a[key] - b[key] for key in shared]) if shared else None


def wilson_interval(successes: int, n: int) -> tuple[float, float]:
    """The 95% Wilson score interval of a binomial proportion ``successes / n``:
    (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n). (0, 1) when n = 0."""
    if not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    z2 = Z_95**2
    p = successes / n
    centre = p + z2 / (2 * n)
    half = Z_95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z2 / n)), min(1.0, (centre + half) / (1 + z2 / n))
