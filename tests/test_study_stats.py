"""The study's intervals on tiny inputs worked out by hand: t intervals, paired differences, Wilson intervals."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vcpo.study.stats import Interval, paired_difference, t_interval, t_quantile_975, wilson_interval


def test_t_quantiles_from_the_table_and_the_expansion():
    assert t_quantile_975(1) == 12.706 and t_quantile_975(3) == 3.182 and t_quantile_975(30) == 2.042
    # exact t(0.975, 40) = 2.0211, t(0.975, 120) = 1.9799; the expansion is within 1e-3
    assert t_quantile_975(40) == pytest.approx(2.0211, abs=1e-3)
    assert t_quantile_975(120) == pytest.approx(1.9799, abs=1e-3)
    with pytest.raises(ValueError):
        t_quantile_975(0)


def test_t_interval_by_hand():
    # values 1, 2, 3, 4: mean 2.5, sample sd sqrt(((1.5^2 + 0.5^2) x 2) / 3) = sqrt(5/3) = 1.29099;
    # half width t(3) x sd / sqrt(4) = 3.182 x 1.29099 / 2 = 2.05397
    iv = t_interval([1.0, 2.0, 3.0, 4.0])
    assert (iv.mean, iv.n) == (2.5, 4)
    assert iv.low == pytest.approx(2.5 - 2.05397, abs=1e-5) and iv.high == pytest.approx(2.5 + 2.05397, abs=1e-5)
    assert iv.excludes_zero() and str(iv) == "2.500 [0.446, 4.554]"
    single = t_interval([0.3])  # one run: no spread to estimate
    assert single == Interval(0.3, 0.3, 0.3, 1) and not single.excludes_zero() and str(single) == "0.300 (n=1)"
    with pytest.raises(ValueError):
        t_interval([])


def test_paired_difference_uses_shared_runs_only():
    a = {("w0", 0): 0.50, ("w0", 1): 0.60, ("w1", 0): 0.40, ("w1", 1): 0.45}
    b = {("w0", 0): 0.40, ("w0", 1): 0.50, ("w1", 0): 0.30, ("w1", 2): 0.99}
    # shared: (w0,0), (w0,1), (w1,0) -> differences 0.1, 0.1, 0.1: mean 0.1, zero spread
    iv = paired_difference(a, b)
    assert iv.n == 3 and iv.mean == pytest.approx(0.1)
    assert iv.low == pytest.approx(0.1) and iv.high == pytest.approx(0.1) and iv.excludes_zero()
    # differences 0.1 and -0.1: mean 0, sd sqrt(0.02) = 0.14142, half width 12.706 x 0.14142 / sqrt(2) = 1.2706
    iv = paired_difference({1: 0.5, 2: 0.3}, {1: 0.4, 2: 0.4})
    assert iv.mean == pytest.approx(0.0) and iv.high == pytest.approx(1.2706, abs=1e-4) and not iv.excludes_zero()
    assert paired_difference({1: 0.5}, {2: 0.5}) is None


def test_wilson_interval_by_hand():
    # 0 of 10: p = 0, z^2 = 3.8415; centre 3.8415/20 = 0.19207, half 1.96 x sqrt(3.8415/400) = 0.19207,
    # so low 0 and high 2 x 0.19207 / (1 + 0.38415) = 0.27753
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.27753, abs=1e-5)
    # 5 of 10: symmetric around 0.5; half = 1.96 x sqrt(0.025 + 0.0096) / 1.38415 = 0.26340
    low, high = wilson_interval(5, 10)
    assert low == pytest.approx(0.5 - 0.26340, abs=1e-4) and high == pytest.approx(0.5 + 0.26340, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


@given(st.integers(0, 200), st.integers(1, 200))
def test_wilson_interval_contains_the_rate_and_stays_in_0_1(successes, n):
    successes = min(successes, n)
    low, high = wilson_interval(successes, n)
    assert 0.0 <= low <= successes / n + 1e-12 and successes / n - 1e-12 <= high <= 1.0


@given(st.lists(st.floats(-1, 1, allow_nan=False), min_size=2, max_size=40))
def test_t_interval_contains_its_mean_and_narrows_with_copies(values):
    iv = t_interval(values)
    assert iv.low <= iv.mean <= iv.high
    doubled = t_interval(values * 2)  # the same spread from twice the runs: a narrower interval
    assert doubled.high - doubled.low <= iv.high - iv.low + 1e-12
    assert math.isfinite(iv.low) and math.isfinite(iv.high)
