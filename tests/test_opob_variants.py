"""OPOB's variants (plug-in, leave-one-out, gradient-only) with both weightings: values worked out by hand,
their agreement when every W and G is equal, log-space stability and the fallbacks, and properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vcpo.variance import OPOB_VARIANTS, compute_advantages, opob_advantages, opob_baseline

from conftest import LN2

F64 = torch.float64
S2 = math.sqrt(2.0)


def t64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def ids(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


# Two interleaved groups (ids 7 and -3), as in test_variance.py's plug-in example.
# Group 7 (rows 0, 2, 3): W = [1, 2, 1], G = [1, 1, 2], R = [1, 0, 1] -> W^2 G = [1, 4, 2].
# Group -3 (rows 1, 4):    W = [3, 1],    G = [1, 3],    R = [2, 0]    -> W^2 G = [9, 3].
GROUP_IDS = ids([7, -3, 7, 7, -3])
REWARDS = t64([1.0, 2.0, 0.0, 1.0, 0.0])
LOGW = t64([0.0, math.log(3.0), LN2, 0.0, 0.0])
NORMS = t64([1.0, 1.0, 1.0, 2.0, 3.0])


def test_leave_one_out_by_hand():
    # Group 7: b_{-0} = (4*0 + 2*1) / (4 + 2) = 1/3; b_{-2} = (1*1 + 2*1) / (1 + 2) = 1; b_{-3} = (1*1 + 4*0) / 5 = 1/5.
    # Group -3: each row's only other row: b_{-1} = R_4 = 0, b_{-4} = R_1 = 2.
    b = opob_baseline(REWARDS, LOGW, NORMS, GROUP_IDS, variant="leave_one_out")
    torch.testing.assert_close(b, t64([1 / 3, 0.0, 1.0, 1 / 5, 2.0]))
    # sigma_7 = sqrt(2)/3 (mean 2/3, var 2/9), sigma_-3 = 1.
    # Ahat: (1 - 1/3) * 3/sqrt2 = sqrt2; (0 - 1) * 3/sqrt2 = -3/sqrt2; (1 - 1/5) * 3/sqrt2 = 12/(5 sqrt2);
    #   group -3: 2 - 0 = 2, 0 - 2 = -2.
    a = opob_advantages(REWARDS, LOGW, NORMS, GROUP_IDS, variant="leave_one_out")
    torch.testing.assert_close(a, t64([S2, 2.0, -3 / S2, 12 / (5 * S2), -2.0]))
    # Self-inclusion: the plug-in b_7 = 3/7 and p_0 = 1/7, so R_0 - b_7 = 4/7 = (1 - 1/7)(1 - 1/3) = (6/7)(2/3).
    plugin = opob_baseline(REWARDS, LOGW, NORMS, GROUP_IDS)
    assert (REWARDS[0] - plugin[0]).item() == pytest.approx((6 / 7) * (1 - 1 / 3))


def test_grad_only_by_hand():
    # Weights G alone. Group 7: w = [1, 1, 2] -> b = (1 + 0 + 2) / 4 = 3/4. Group -3: w = [1, 3] -> b = 2/4 = 1/2.
    b = opob_baseline(REWARDS, LOGW, NORMS, GROUP_IDS, variant="grad_only")
    torch.testing.assert_close(b, t64([0.75, 0.5, 0.75, 0.75, 0.5]))
    # Ahat group 7: (1 - 3/4) * 3/sqrt2 = 3/(4 sqrt2); (0 - 3/4) * 3/sqrt2 = -9/(4 sqrt2). Group -3: 1.5, -0.5.
    a = opob_advantages(REWARDS, LOGW, NORMS, GROUP_IDS, variant="grad_only")
    torch.testing.assert_close(a, t64([3 / (4 * S2), 1.5, -9 / (4 * S2), 3 / (4 * S2), -0.5]))


def test_variants_with_the_authors_code_weighting_by_hand():
    # W = [1, 2, 4], G = 1, R = [0, 1, 2], cap 2 -> min(W, 2)^2 = [1, 4, 4].
    # grad_only + authors_code: w = min(W, 2)^2 G = [1, 4, 4] -> b = (0 + 4 + 8) / 9 = 4/3.
    # leave_one_out + authors_code: w = W^2 min(W, 2)^2 G = [1, 16, 64]:
    #   b_{-0} = (16 + 128) / 80 = 9/5; b_{-1} = (0 + 128) / 65 = 128/65; b_{-2} = (0 + 16) / 17 = 16/17.
    rewards, logw, g, group_ids = t64([0.0, 1.0, 2.0]), t64([0.0, LN2, 2 * LN2]), t64([1.0] * 3), ids([0] * 3)
    kw = {"weighting": "authors_code", "cap": 2.0}
    torch.testing.assert_close(opob_baseline(rewards, logw, g, group_ids, variant="grad_only", **kw), t64([4 / 3] * 3))
    torch.testing.assert_close(opob_baseline(rewards, logw, g, group_ids, variant="leave_one_out", **kw),
                               t64([9 / 5, 128 / 65, 16 / 17]))
    # At or below the cap (here W <= 3 < 4) the authors' G carries exactly W^2: grad_only + authors_code is the
    # plug-in paper baseline.
    torch.testing.assert_close(
        opob_baseline(REWARDS, LOGW, NORMS, GROUP_IDS, variant="grad_only", weighting="authors_code", cap=4.0),
        opob_baseline(REWARDS, LOGW, NORMS, GROUP_IDS),
    )


@pytest.mark.parametrize("weighting", ["paper", "authors_code"])
def test_the_three_variants_agree_when_every_weight_and_norm_is_equal(weighting):
    # Equal W and G: plug-in and grad-only are the group mean, bit for bit; leave-one-out is the others' mean,
    # whose advantage is RLOO's n/(n - 1) times the plug-in one (R_i - mean_{-i} = n/(n-1) (R_i - mean)).
    group_ids = ids([0, 0, 0, 5, 5, 5, 5])
    rewards = t64([1.0, 0.0, 0.5, 3.0, -1.0, 0.0, 2.0])
    logw, g = torch.full((7,), 2.5, dtype=F64), torch.full((7,), 3.0, dtype=F64)
    kw = {"weighting": weighting}
    plugin = opob_advantages(rewards, logw, g, group_ids, variant="plugin", **kw)
    assert torch.equal(plugin, opob_advantages(rewards, logw, g, group_ids, variant="grad_only", **kw))
    n = t64([3.0] * 3 + [4.0] * 4)
    torch.testing.assert_close(opob_advantages(rewards, logw, g, group_ids, variant="leave_one_out", **kw),
                               n / (n - 1) * plugin)
    # The baselines themselves: group 0's mean 0.5; row 0's others [0, 0.5] -> 0.25.
    b = opob_baseline(rewards, logw, g, group_ids, variant="leave_one_out", **kw)
    assert b[0].item() == pytest.approx(0.25) and b[3].item() == pytest.approx(1 / 3)


def test_leave_one_out_keeps_the_others_relative_weights_under_a_dominant_row():
    # logw [1000, -1000, -1000 + ln3 / 2], G = 1 -> W^2 = [e^2000, e^-2000, 3 e^-2000], R = [2, 5, 7].
    # Row 0's others: (5 + 3 * 7) / 4 = 6.5 (subtracting row 0 from the group's sum would leave 0/0 -> mean 6).
    # Rows 1 and 2: row 0 dominates their others -> 2.
    logw = t64([1000.0, -1000.0, -1000.0 + math.log(3.0) / 2])
    b = opob_baseline(t64([2.0, 5.0, 7.0]), logw, t64([1.0] * 3), ids([0] * 3), variant="leave_one_out")
    torch.testing.assert_close(b, t64([6.5, 2.0, 2.0]))


def test_leave_one_out_fallbacks():
    # Group 0: all G = 0 -> the others' mean reward: R = [1, 3, 5] -> [4, 3, 2].
    # Group 1: G = [2, 0], R = [10, -4]: row 0's only other row weighs 0 -> its reward -4; row 1's -> 10.
    # Group 2: logw [inf, 0], R = [0, 6]: row 0 sees row 1 -> 6; row 1 sees an infinite weight -> the others' mean 0.
    # Group 3: one row, no others -> its own reward (advantage 0).
    rewards = t64([1.0, 3.0, 5.0, 10.0, -4.0, 0.0, 6.0, 9.0])
    logw = t64([0.0, 0.0, 0.0, 0.0, 0.0, float("inf"), 0.0, 0.0])
    g = t64([0.0, 0.0, 0.0, 2.0, 0.0, 1.0, 1.0, 1.0])
    group_ids = ids([0, 0, 0, 1, 1, 2, 2, 3])
    b = opob_baseline(rewards, logw, g, group_ids, variant="leave_one_out")
    torch.testing.assert_close(b, t64([4.0, 3.0, 2.0, -4.0, 10.0, 6.0, 0.0, 9.0]))
    assert opob_advantages(rewards, logw, g, group_ids, variant="leave_one_out")[7].item() == 0.0


def test_variant_errors_and_dispatch():
    with pytest.raises(ValueError, match="valid variants: plugin, leave_one_out, grad_only"):
        opob_baseline(REWARDS, LOGW, NORMS, GROUP_IDS, variant="loo")
    for variant in OPOB_VARIANTS:
        torch.testing.assert_close(
            compute_advantages("opob", REWARDS, GROUP_IDS, logw=LOGW, grad_sq_norms=NORMS, variant=variant),
            opob_advantages(REWARDS, LOGW, NORMS, GROUP_IDS, variant=variant),
        )


_rows = st.tuples(st.integers(0, 3), st.floats(-30, 30), st.floats(1e-3, 1e3), st.floats(-5, 5))


@settings(max_examples=80, deadline=None)
@given(st.lists(_rows, min_size=2, max_size=12), st.sampled_from(["paper", "authors_code"]))
def test_plugin_is_leave_one_out_shrunk_by_the_own_share_property(rows, weighting):
    # R_i - b_g = (1 - p_i)(R_i - b_{-i}) with p_i = w_i / sum_{j in g} w_j, for any positive weights.
    group_ids, logw, g, rewards = (list(c) for c in zip(*rows, strict=True))
    gid, r, lw, norms = ids(group_ids), t64(rewards), t64(logw), t64(g)
    kw = {"weighting": weighting, "cap": 8.0}
    plugin = opob_baseline(r, lw, norms, gid, **kw)
    loo = opob_baseline(r, lw, norms, gid, variant="leave_one_out", **kw)
    log_w = 2 * lw + norms.log() + (2 * lw.clamp(max=math.log(8.0)) if weighting == "authors_code" else 0)
    for i in range(len(rows)):
        in_g = gid == gid[i]
        if int(in_g.sum()) == 1:
            assert loo[i].item() == r[i].item()
            continue
        p_i = math.exp(log_w[i].item() - torch.logsumexp(log_w[in_g], 0).item())
        assert (r[i] - plugin[i]).item() == pytest.approx((1 - p_i) * (r[i] - loo[i]).item(), abs=1e-9, rel=1e-7)


_extreme_rows = st.tuples(
    st.integers(0, 3), st.floats(-1000, 1000), st.one_of(st.just(0.0), st.floats(1e-6, 1e6)), st.floats(-5, 5)
)


@settings(max_examples=80, deadline=None)
@given(st.lists(_extreme_rows, min_size=1, max_size=12), st.sampled_from(OPOB_VARIANTS),
       st.sampled_from(["paper", "authors_code"]))
def test_every_variant_finite_and_a_convex_combination_property(rows, variant, weighting):
    # Each baseline is a weighted (or plain) mean of rewards of its group: of the OTHER rows for leave-one-out.
    group_ids, logw, g, rewards = (list(c) for c in zip(*rows, strict=True))
    gid, r = ids(group_ids), t64(rewards)
    b = opob_baseline(r, t64(logw), t64(g), gid, variant=variant, weighting=weighting)
    a = opob_advantages(r, t64(logw), t64(g), gid, variant=variant, weighting=weighting)
    assert torch.isfinite(b).all() and torch.isfinite(a).all()
    for i in range(len(rows)):
        pool = gid == gid[i]
        if variant == "leave_one_out" and int(pool.sum()) > 1:
            pool[i] = False
        assert r[pool].min() - 1e-9 <= b[i] <= r[pool].max() + 1e-9
