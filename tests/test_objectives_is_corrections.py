"""tis, mis, icepop, m2po, topr: hand-worked values, gradients, invariants, metrics, errors, aggregation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from vcpo.objectives import LOSS_AGG_MODES, aggregate, get_objective
from vcpo.objectives.m2po import second_moment_keep_mask

from conftest import LN2, make_inputs

LN3 = math.log(3.0)


def _f64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def _shifted(lp, d):
    """Behavior log-probs ``blp = lp - d``, so that lp - blp = d exactly as written."""
    return (_f64(lp) - _f64(d)).tolist()


# --------------------------------------------------------------------------- tis
# Shared batch: lp = [[-1, -2], [-0.5, -1]], d = lp - blp = [[ln4, -ln2], [0, ln3]], A = [1, -2].
TIS_LP = [[-1.0, -2.0], [-0.5, -1.0]]
TIS_D = [[2 * LN2, -LN2], [0.0, LN3]]


def test_tis_token_hand_values():
    # r = [[4, 0.5], [1, 3]], cap 2 -> w = [[2, 0.5], [1, 2]].
    # l = -w*A*lp: row0 [-2*1*-1, -0.5*1*-2] = [2, 1]; row1 [-1*-2*-0.5, -2*-2*-1] = [-1, -4]
    # token-mean: (2 + 1 - 1 - 4) / 4 = -0.5.
    inp, lp = make_inputs(TIS_LP, _shifted(TIS_LP, TIS_D), [1.0, -2.0])
    out = get_objective("tis")(inp)
    assert out.loss.item() == pytest.approx(-0.5)
    out.loss.backward()
    # d/dlp = -w*A/4: row0 [-2/4, -0.5/4], row1 [2/4, 4/4]
    torch.testing.assert_close(lp.grad, _f64([[-0.5, -0.125], [0.5, 1.0]]))
    # r = 4 and r = 3 exceed the cap: 2 of 4 tokens; mean w = (2 + 0.5 + 1 + 2) / 4 = 1.375
    assert out.metrics["clip/frac"] == pytest.approx(0.5)
    assert out.metrics["tis/weight_mean"] == pytest.approx(1.375)


def test_tis_sequence_hand_values():
    # logW = [ln4 - ln2, 0 + ln3] -> W = [2, 3]; cap 2.5 -> w = [2, 2.5] (row 1 truncated).
    # l: row0 -2*1*(-1 - 2) = 6 ; row1 -2.5*(-2)*(-0.5 - 1) = -7.5 ; token-mean -1.5 / 4 = -0.375
    inp, lp = make_inputs(TIS_LP, _shifted(TIS_LP, TIS_D), [1.0, -2.0])
    out = get_objective("tis")(inp, level="sequence", cap=2.5)
    assert out.loss.item() == pytest.approx(-0.375)
    out.loss.backward()
    # d/dlp = -w_i*A_i/4: row0 -2/4 = -0.5 ; row1 -2.5*(-2)/4 = 1.25
    torch.testing.assert_close(lp.grad, _f64([[-0.5, -0.5], [1.25, 1.25]]))
    # one of two sequences truncated; mean w over sequences (2 + 2.5) / 2 = 2.25
    assert out.metrics["clip/frac"] == pytest.approx(0.5)
    assert out.metrics["tis/weight_mean"] == pytest.approx(2.25)


# --------------------------------------------------------------------------- mis
# lp as for tis, d = [[ln1.5, ln0.25], [0, ln3]] -> r = [[1.5, 0.25], [1, 3]], A = [1, -2].
MIS_D = [[math.log(1.5), math.log(0.25)], [0.0, LN3]]


def test_mis_token_hand_values():
    # Default [0.5, 2]: keep r = 1.5 and r = 1, drop 0.25 and 3 -> w = [[1.5, 0], [1, 0]].
    # l: row0 tok0 -1.5*1*(-1) = 1.5 ; row1 tok0 -1*(-2)*(-0.5) = -1 ; pre-mask count 4:
    # token-mean (1.5 - 1) / 4 = 0.125.
    inp, lp = make_inputs(TIS_LP, _shifted(TIS_LP, MIS_D), [1.0, -2.0])
    out = get_objective("mis")(inp)
    assert out.loss.item() == pytest.approx(0.125)
    out.loss.backward()
    # d/dlp = -w*A/4: [[-1.5/4, 0], [2/4, 0]]
    torch.testing.assert_close(lp.grad, _f64([[-0.375, 0.0], [0.5, 0.0]]))
    assert out.metrics["mask/frac"] == pytest.approx(0.5)
    assert out.metrics["mis/weight_mean"] == pytest.approx((1.5 + 1.0) / 4)


def test_mis_sequence_and_geometric_hand_values():
    # Sequence ratios W = [1.5*0.25, 1*3] = [0.375, 3]: both outside the default [0.5, 2].
    inp, _ = make_inputs(TIS_LP, _shifted(TIS_LP, MIS_D), [1.0, -2.0])
    out = get_objective("mis")(inp, level="sequence")
    assert out.loss.item() == 0.0 and out.metrics["mask/frac"] == 1.0
    # Bounds [0.3, 4] keep both: l = row0 -0.375*1*(-3) = 1.125, row1 -3*(-2)*(-1.5) = -9
    # token-mean (1.125 - 9) / 4 = -1.96875 ; grad -w_i*A_i/4 = [-0.09375, 1.5]
    inp, lp = make_inputs(TIS_LP, _shifted(TIS_LP, MIS_D), [1.0, -2.0])
    out = get_objective("mis")(inp, level="sequence", low=0.3, high=4.0)
    assert out.loss.item() == pytest.approx(-1.96875)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, _f64([[-0.09375] * 2, [1.5] * 2]))
    assert out.metrics["mis/weight_mean"] == pytest.approx((0.375 * 2 + 3 * 2) / 4)
    # Geometric means sqrt(0.375) = 0.612 and sqrt(3) = 1.732; bounds [0.5, 1.5] keep row 0 only:
    # l = -sqrt(.375)*1*(-3) over 4 tokens.
    inp, lp = make_inputs(TIS_LP, _shifted(TIS_LP, MIS_D), [1.0, -2.0])
    out = get_objective("mis")(inp, level="geometric", low=0.5, high=1.5)
    assert out.loss.item() == pytest.approx(3 * math.sqrt(0.375) / 4)
    assert out.metrics["mask/frac"] == pytest.approx(0.5)
    # The default geometric bounds [0.999, 1.001] reject both rows.
    inp, _ = make_inputs(TIS_LP, _shifted(TIS_LP, MIS_D), [1.0, -2.0])
    assert get_objective("mis")(inp, level="geometric").metrics["mask/frac"] == 1.0


def test_mis_geometric_uses_counted_length():
    # Row d = [ln4, (masked) 7]: logW = ln4 over L = 1 token -> geometric ratio 4, not 2.
    inp, _ = make_inputs([[0.0, 0.0]], [[-2 * LN2, -7.0]], [1.0], mask=[[1, 0]])
    assert get_objective("mis")(inp, level="geometric", high=3.0).metrics["mask/frac"] == 1.0
    inp, _ = make_inputs([[0.0, 0.0]], [[-2 * LN2, -7.0]], [1.0], mask=[[1, 0]])
    assert get_objective("mis")(inp, level="geometric", high=5.0).metrics["mask/frac"] == 0.0


def test_mis_unit_weight_hand_values():
    # Token level, default [0.5, 2]: keep r = 1.5 (row0 tok0) and r = 1 (row1 tok0);
    # unit weight -> w = [[1, 0], [1, 0]].
    # l = -w*A*lp: row0 tok0 -1*1*(-1) = 1 ; row1 tok0 -1*(-2)*(-0.5) = -1 ; token-mean (1 - 1)/4 = 0.
    inp, lp = make_inputs(TIS_LP, _shifted(TIS_LP, MIS_D), [1.0, -2.0])
    out = get_objective("mis")(inp, weight="unit")
    assert out.loss.item() == pytest.approx(0.0)
    out.loss.backward()
    # d/dlp = -w*A/4: [[-1/4, 0], [2/4, 0]]
    torch.testing.assert_close(lp.grad, _f64([[-0.25, 0.0], [0.5, 0.0]]))
    assert out.metrics["mask/frac"] == pytest.approx(0.5) and out.metrics["mis/weight_mean"] == pytest.approx(0.5)


def test_mis_geometric_unit_weight_is_verls_geo_rs_preset():
    # Geometric ratios g = [sqrt(.375), sqrt(3)] = [0.612, 1.732]; bounds [0.5, 1.5] keep row 0 only.
    # weight="ratio": l_row0 = -0.612*1*(-1 - 2) = 3*0.612 ; weight="unit": l_row0 = -1*1*(-3) = 3.
    # token-mean over the 4 pre-mask tokens: 3/4 ; gradient -w*A/4 = -1/4 on row 0, 0 on row 1.
    inp, lp = make_inputs(TIS_LP, _shifted(TIS_LP, MIS_D), [1.0, -2.0])
    out = get_objective("mis")(inp, level="geometric", low=0.5, high=1.5, weight="unit")
    assert out.loss.item() == pytest.approx(0.75)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, _f64([[-0.25, -0.25], [0.0, 0.0]]))
    # verl's bypass_pg_geo_rs: kept rows weigh 1, rejected rows 0, rows with |mean d| <= ~1e-3 kept
    # (d = 0.0005 per token: g = e^0.0005 = 1.0005 in [0.999, 1.001]; d = 0.002: g = 1.002 rejected).
    inp, lp = make_inputs([[-1.0, -1.0], [-1.0, -1.0]], [[-1.0005, -1.0005], [-1.002, -1.002]], [1.0, 1.0])
    out = get_objective("mis")(inp, level="geometric", weight="unit")
    out.loss.backward()
    assert out.metrics["mask/frac"] == pytest.approx(0.5)
    torch.testing.assert_close(lp.grad, _f64([[-0.25, -0.25], [0.0, 0.0]]))


# --------------------------------------------------------------------------- icepop
def test_icepop_bypass_hand_values():
    # r = k = exp(lp - blp); A = [1, -1]. Row0 r = [1.1, 6, 1.5], row1 r = [0.4, 1, 1.5].
    # Mask [0.5, 5] drops 6 and 0.4. PPO on kept tokens (eps 0.2):
    #   row0: 1.1 -> max(-1.1, -1.1) = -1.1 (grad -1.1) ; 1.5 -> max(-1.5, -1.2) = -1.2 (clipped, grad 0)
    #   row1: 1 -> 1 (grad r = 1) ; 1.5 with A < 0 -> max(1.5, 1.2) = 1.5 (grad 1.5)
    # seq-mean-token-mean: mean((-1.1 + 0 - 1.2)/3, (0 + 1 + 1.5)/3) = (0.2/3)/2 = 1/30.
    d = [[math.log(1.1), math.log(6.0), math.log(1.5)], [math.log(0.4), 0.0, math.log(1.5)]]
    lp0 = [[-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0]]
    inp, lp = make_inputs(lp0, _shifted(lp0, d), [1.0, -1.0])
    out = get_objective("icepop")(inp)
    assert out.loss.item() == pytest.approx(1 / 30)
    out.loss.backward()
    # gradient / (3 tokens * 2 rows)
    torch.testing.assert_close(lp.grad, _f64([[-1.1 / 6, 0.0, 0.0], [0.0, 1 / 6, 0.25]]))
    assert out.metrics["mask/frac"] == pytest.approx(2 / 6)
    # clipped over all counted tokens: 6 and 1.5 (A > 0), 0.4 (A < 0) -> 3 / 6
    assert out.metrics["clip/frac"] == pytest.approx(0.5)


def test_icepop_decoupled_masks_on_old_policy_and_calibrates():
    # blp = 0, olp = [ln2, ln8], lp = [ln6, ln2], A = -1.
    # k = exp(olp - blp) = [2, 8]: token 1 dropped although exp(lp - blp) = 2 is in range,
    # and token 0 kept although exp(lp - blp) = 6 is not.
    # Token 0: r = exp(lp - olp) = 3; A < 0 so max(3, 1.2) = 3; times sg(k) = 2 -> l = 6, grad k*r = 6.
    # token-mean over 2 tokens: loss 3, grad [3, 0].
    inp, lp = make_inputs([[math.log(6.0), LN2]], [[0.0, 0.0]], [-1.0], old_logprobs=[[LN2, 3 * LN2]])
    out = get_objective("icepop")(inp, loss_agg="token-mean")
    assert out.loss.item() == pytest.approx(3.0)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, _f64([[3.0, 0.0]]))
    assert out.metrics["mask/frac"] == pytest.approx(0.5)
    # Dual-clip reaches the PPO part: r = k = e^3 = 20.1 (kept with high 30), A = -1, c = 3 -> l = 3.
    inp, _ = make_inputs([[3.0]], [[0.0]], [-1.0])
    out = get_objective("icepop")(inp, high=30.0, dual_clip=3.0)
    assert out.loss.item() == pytest.approx(3.0) and out.metrics["clip/frac_dual"] == 1.0


# --------------------------------------------------------------------------- m2po
def _brute_force_keep_count(values: list[float], tau: float) -> int:
    """Largest subset size whose mean is <= tau, by trying every subset."""
    for k in range(len(values), 0, -1):
        if any(sum(c) <= tau * k for c in itertools.combinations(values, k)):
            return k
    return 0


def test_m2po_mask_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):
        B, T = int(torch.randint(1, 3, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
        sq = (0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)) ** 2
        mask = torch.rand(B, T, generator=gen) < 0.8
        tau = float(torch.rand(1, generator=gen)) * 0.1
        keep = second_moment_keep_mask(sq, mask, tau)
        values = sq[mask].tolist()
        k = _brute_force_keep_count(values, tau)
        assert int(keep.sum()) == k and not (keep & ~mask).any()
        # The kept tokens are the k smallest, and their mean respects the budget.
        assert sorted(sq[keep].tolist()) == sorted(values)[:k]
        if k:
            assert sq[keep].mean().item() <= tau + 1e-12


def test_m2po_bypass_hand_values():
    # d = lp - blp = [[0.1, 0.5], [-0.1, 0]] -> sq = [[.01, .25], [.01, 0]], M2 = .27/4 = .0675.
    # Ascending 0, .01, .01, .25: prefix sums 0, .01, .02, .27 vs tau*k = .04, .08, .12, .16
    # -> keep 3, mask the .25 token; M2 after = .02/3.
    # l = -r*A, A = [1, -1]: kept [-e^.1, masked, e^-.1, 1]; token-mean over the 4 pre-mask tokens.
    lp0 = [[-1.0, -2.0], [-1.5, -0.5]]
    inp, lp = make_inputs(lp0, _shifted(lp0, [[0.1, 0.5], [-0.1, 0.0]]), [1.0, -1.0])
    out = get_objective("m2po")(inp)
    assert out.loss.item() == pytest.approx((-math.exp(0.1) + math.exp(-0.1) + 1) / 4)
    out.loss.backward()
    # d/dlp(-r*A) = -r*A: [[-e^.1, 0], [e^-.1, 1]] / 4
    torch.testing.assert_close(lp.grad, _f64([[-math.exp(0.1) / 4, 0.0], [math.exp(-0.1) / 4, 0.25]]))
    assert out.metrics["m2po/m2_before"] == pytest.approx(0.0675)
    assert out.metrics["m2po/m2_after"] == pytest.approx(0.02 / 3)
    assert out.metrics["mask/frac"] == pytest.approx(0.25)


def test_m2po_with_old_logprobs():
    # blp = 0, olp = [0.3, 0]: sq = [.09, 0], M2 = .045 > .04 -> keep only the 0 token.
    # (Measured against lp instead, sq would be [.09, ln2^2].) r = exp(lp - olp) = [1, 2], A = 1:
    # token-mean (0 - 2)/2 = -1, grad [0, -2/2].
    inp, lp = make_inputs([[0.3, LN2]], [[0.0, 0.0]], [1.0], old_logprobs=[[0.3, 0.0]])
    out = get_objective("m2po")(inp)
    assert out.loss.item() == pytest.approx(-1.0)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, _f64([[0.0, -1.0]]))
    assert out.metrics["m2po/m2_before"] == pytest.approx(0.045)
    assert out.metrics["m2po/m2_after"] == 0.0 and out.metrics["mask/frac"] == 0.5


def test_m2po_everything_masked():
    # sq = [.25, .36] both above tau = .04 -> no subset qualifies: all masked, zero loss.
    inp, lp = make_inputs([[0.5, -0.6]], [[0.0, 0.0]], [1.0])
    out = get_objective("m2po")(inp)
    out.loss.backward()
    assert out.loss.item() == 0.0 and lp.grad.abs().max().item() == 0.0
    assert out.metrics["mask/frac"] == 1.0 and out.metrics["m2po/m2_after"] == 0.0


def test_m2po_behavior_weight_decoupled_as_areal():
    # blp = 0, olp = [0, ln2, ln8], lp = olp + [0, 0, 0] -> r = 1 everywhere; A = 1.
    # sq = (blp - olp)^2 = [0, .480, 4.324]; with tau = 3 the prefix sums 0, .480, 4.80 stay under
    # 3*k = 3, 6, 9, so the second-moment mask keeps all three and only the behavior weight acts.
    # k = exp(olp - blp) = [1, 2, 8]; c = 5 drops token 2 (k = 8 > 5); kept loss -k*r*A = [-1, -2].
    # token-mean over the 3 pre-mask tokens: -3/3 = -1 ; gradient -k*r*A/3 = [-1/3, -2/3, 0].
    olp = [[0.0, LN2, 3 * LN2]]
    inp, lp = make_inputs(olp, [[0.0, 0.0, 0.0]], [1.0], old_logprobs=olp)
    out = get_objective("m2po")(inp, tau=3.0, behavior_weight_max=5.0)
    assert out.loss.item() == pytest.approx(-1.0)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, _f64([[-1 / 3, -2 / 3, 0.0]]))
    assert out.metrics["m2po/behavior_drop_frac"] == pytest.approx(1 / 3)
    assert out.metrics["mask/frac"] == pytest.approx(1 / 3)
    # Default (the paper's form): no k factor, nothing dropped for k: loss -(1 + 1 + 1)/3 = -1, grad -1/3 each.
    inp, lp = make_inputs(olp, [[0.0, 0.0, 0.0]], [1.0], old_logprobs=olp)
    out = get_objective("m2po")(inp, tau=3.0)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, _f64([[-1 / 3] * 3]))
    assert out.metrics["m2po/behavior_drop_frac"] == 0.0
    # c = inf: the factor without the drop: -(1 + 2 + 8)/3.
    inp, _ = make_inputs(olp, [[0.0, 0.0, 0.0]], [1.0], old_logprobs=olp)
    assert get_objective("m2po")(inp, tau=3.0, behavior_weight_max=math.inf).loss.item() == pytest.approx(-11 / 3)


def test_m2po_behavior_weight_in_bypass_mode_only_drops():
    # Bypass: r = exp(lp - blp) = [1, 2, 8] already holds k; tau = 3 keeps all (as above).
    # c = 5 drops the k = 8 token and adds no second factor: loss -(1 + 2)/3 = -1, grad -r*A/3 = [-1/3, -2/3, 0].
    inp, lp = make_inputs([[0.0, LN2, 3 * LN2]], [[0.0, 0.0, 0.0]], [1.0])
    out = get_objective("m2po")(inp, tau=3.0, behavior_weight_max=5.0)
    assert out.loss.item() == pytest.approx(-1.0)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, _f64([[-1 / 3, -2 / 3, 0.0]]))


# --------------------------------------------------------------------------- topr
# Rewards [1, -1, -2]; d row0 [ln2, ln2] (W = 4), row1 [ln2, -ln4] (W = 0.5), row2 [ln3, 0] (W = 3).
TOPR_LP = [[-1.0, -2.0], [-0.5, -1.0], [-1.0, -1.0]]
TOPR_D = [[LN2, LN2], [LN2, -2 * LN2], [LN3, 0.0]]


def _topr_inputs(**kw):
    return make_inputs(TOPR_LP, _shifted(TOPR_LP, TOPR_D), [0.0, 0.0, 0.0], rewards=[1.0, -1.0, -2.0], **kw)


def test_topr_sequence_hand_values():
    # w = [1 (R >= 0, no IS), min(0.5, 1) = 0.5, min(3, 1) = 1]. l = -w*R*lp summed per row:
    # row0 -1*(-1 - 2) = 3 ; row1 -0.5*(-1)*(-1.5) = -0.75 ; row2 -1*(-2)*(-2) = -4
    # seq-mean-token-sum: (3 - 0.75 - 4)/3 = -1.75/3.
    inp, lp = _topr_inputs()
    out = get_objective("topr")(inp)
    assert out.loss.item() == pytest.approx(-1.75 / 3)
    out.loss.backward()
    # d/dlp = -w*R/3: row0 -1/3, row1 0.5/3, row2 2/3
    torch.testing.assert_close(lp.grad, _f64([[-1 / 3] * 2, [1 / 6] * 2, [2 / 3] * 2]))
    assert out.metrics["topr/pos_frac"] == pytest.approx(1 / 3)
    # negative tokens carry w = 0.5, 0.5, 1, 1 -> 0.75
    assert out.metrics["topr/neg_weight_mean"] == pytest.approx(0.75)


def test_topr_token_hand_values():
    # Token ratios clipped to [0, 1]: row1 [2, .25] -> [1, .25], row2 [3, 1] -> [1, 1].
    # row1 l = -1*(-1)*(-0.5) - .25*(-1)*(-1) = -0.75 ; grads -w*R/3 -> row1 [1/3, 1/12].
    inp, lp = _topr_inputs()
    out = get_objective("topr")(inp, level="token")
    assert out.loss.item() == pytest.approx(-1.75 / 3)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, _f64([[-1 / 3] * 2, [1 / 3, 1 / 12], [2 / 3] * 2]))
    assert out.metrics["topr/neg_weight_mean"] == pytest.approx((1 + 0.25 + 1 + 1) / 4)


def test_topr_zero_reward_and_token_advantage_fallback():
    # R = 0 counts as positive (paper: R >= 0) and contributes nothing even with a huge ratio.
    inp, lp = make_inputs([[-1.0], [-1.0]], [[-50.0], [-1.0]], [0.0, 0.0], rewards=[0.0, -1.0])
    out = get_objective("topr")(inp)
    out.loss.backward()
    assert out.metrics["topr/pos_frac"] == 0.5 and lp.grad[0, 0].item() == 0.0
    # No rewards: per-token advantages [[2, -1]], d = [ln2, ln.25] -> W = 0.5.
    # tok0 positive w = 1, tok1 negative w = 0.5: l = -2*(-1) - 0.5*(-1)*(-2) = 1 ; grad [-2, 0.5]
    inp, lp = make_inputs([[-1.0, -2.0]], _shifted([[-1.0, -2.0]], [[LN2, -2 * LN2]]), [[2.0, -1.0]])
    out = get_objective("topr")(inp)
    assert out.loss.item() == pytest.approx(1.0)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, _f64([[-2.0, 0.5]]))
    assert out.metrics["topr/pos_frac"] == 0.5
    assert out.metrics["topr/neg_weight_mean"] == pytest.approx(0.5)


# --------------------------------------------------------------------------- shared properties
CONFIGS = [
    ("tis", {}), ("tis", {"level": "sequence", "cap": 8.0}),
    ("mis", {}), ("mis", {"level": "sequence"}), ("mis", {"level": "geometric"}),
    ("icepop", {}), ("m2po", {}), ("topr", {}), ("topr", {"level": "token"}),
]


@pytest.mark.parametrize(("name", "kw"), CONFIGS)
def test_on_policy_gradient_equals_reinforce(name, kw):
    # lp == blp, no old_logprobs: every weight is 1, nothing masked or clipped.
    torch.manual_seed(1)
    lp0 = (torch.randn(3, 4, dtype=torch.float64) - 1.0).tolist()
    adv = torch.randn(3, dtype=torch.float64).tolist()
    mask = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    grads = []
    for obj, extra in ((name, kw), ("reinforce", {})):
        inp, lp = make_inputs(lp0, lp0, adv, mask=mask)
        get_objective(obj)(inp, loss_agg="seq-mean-token-mean", **extra).loss.backward()
        grads.append(lp.grad)
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize(("name", "kw"), CONFIGS)
@pytest.mark.parametrize("old", [False, True])
def test_extreme_log_ratios_and_empty_rows_stay_finite(name, kw, old):
    lp0 = [[0.0, -1.0, -2.0], [-1.0, -1.0, -1.0], [-3.0, -3.0, -3.0]]
    blp = [[-1000.0, 999.0, -2.0], [1000.0, -1001.0, 0.0], [5.0, 5.0, 5.0]]
    extra = {"old_logprobs": [[-500.0, 500.0, 0.0]] * 3} if old else {}
    for mode in LOSS_AGG_MODES:
        inp, lp = make_inputs(lp0, blp, [1.0, -1.0, 2.0], mask=[[1, 1, 1], [1, 1, 0], [0, 0, 0]],
                              rewards=[1.0, -1.0, 2.0], **extra)
        out = get_objective(name)(inp, loss_agg=mode, max_len=3, **kw)
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all()
        assert lp.grad[2].abs().max().item() == 0.0  # the all-masked row contributes nothing
        assert all(math.isfinite(v) for v in out.metrics.values())


def _expected_per_token(name: str, lp, blp, adv_B, m):
    """Each objective's per-token loss at default settings, written out independently."""
    d = (lp - blp) * m
    r, a = torch.exp(d), adv_B[:, None].expand_as(lp)
    if name == "tis":
        return -r.clamp(max=2.0).detach() * a * lp
    if name == "mis":
        return -(r * ((r >= 0.5) & (r <= 2.0))).detach() * a * lp
    if name == "icepop":
        ppo = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2))
        return torch.where((r.detach() >= 0.5) & (r.detach() <= 5.0), ppo, torch.zeros_like(ppo))
    if name == "m2po":
        sq = d.detach() ** 2
        k = _brute_force_keep_count(sq[m.bool()].tolist(), 0.04)
        keep = (sq <= sorted(sq[m.bool()].tolist())[k - 1]) & m.bool() if k else torch.zeros_like(m).bool()
        return torch.where(keep, -r * a, torch.zeros_like(r))
    w = torch.where(a < 0, torch.exp(d.sum(1, keepdim=True)).clamp(max=1.0).expand_as(lp), torch.ones_like(lp))
    return -w.detach() * a * lp  # topr with rewards = advantages


@pytest.mark.parametrize("name", ["tis", "mis", "icepop", "m2po", "topr"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_every_loss_agg_mode(name, mode):
    # Denominators use the pre-mask counts: compare with aggregate() of the written-out loss.
    # Counted ratios e^d = [[1.11, 6.05, 1.49], [0.41, 1.02]]: TIS truncates 6.05, MIS drops 6.05
    # and 0.41, IcePop drops them too and clips 1.49, M2PO keeps only the two smallest d^2.
    torch.manual_seed(2)
    lp0 = torch.randn(3, 3, dtype=torch.float64) - 1.0
    d = _f64([[0.1, 1.8, 0.4], [-0.9, 0.02, 0.3], [2.0, -1.0, 0.5]])
    adv = [1.0, -0.5, 2.0]
    m = _f64([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    inp, lp = make_inputs(lp0.tolist(), (lp0 - d).tolist(), adv, mask=m.tolist())
    out = get_objective(name)(inp, loss_agg=mode, max_len=4)
    out.loss.backward()
    lp_ref = lp0.clone().requires_grad_(True)
    ref = aggregate(_expected_per_token(name, lp_ref, lp0 - d, _f64(adv), m), m, mode, max_len=4)
    ref.backward()
    torch.testing.assert_close(out.loss, ref)
    torch.testing.assert_close(lp.grad, lp_ref.grad)


@pytest.mark.parametrize(
    ("name", "kw", "culprit"),
    [
        ("tis", {"level": "geometric"}, "level"), ("tis", {"cap": 0.5}, "cap"), ("tis", {"cap": math.nan}, "cap"),
        ("mis", {"level": "seq"}, "level"), ("mis", {"low": 1.5}, "low"), ("mis", {"low": -0.1}, "low"),
        ("mis", {"high": 0.9}, "high"), ("icepop", {"low": 2.0}, "low"), ("icepop", {"high": 0.5}, "high"),
        ("icepop", {"eps_low": 1.5}, "eps_low"), ("icepop", {"dual_clip": 1.0}, "dual_clip"),
        ("m2po", {"tau": 0.0}, "tau"), ("m2po", {"tau": -1.0}, "tau"), ("topr", {"level": "geometric"}, "level"),
        ("topr", {"cap": 2.0}, "cap"), ("mis", {"weight": "one"}, "weight"),
        ("m2po", {"behavior_weight_max": 0.5}, "behavior_weight_max"),
        ("m2po", {"behavior_weight_max": math.nan}, "behavior_weight_max"),
    ],
)
def test_bad_hyperparameters_raise_naming_them(name, kw, culprit):
    inp, _ = make_inputs([[0.0]], [[0.0]], [1.0])
    with pytest.raises(ValueError, match=culprit):
        get_objective(name)(inp, **kw)
