"""vespo, bapo, tb and vcpo: hand-worked values, closed-form gradients, invariants, metrics, errors."""

from __future__ import annotations

import math

import pytest
import torch

from vcpo.objectives import LOSS_AGG_MODES, aggregate, get_objective
from vcpo.objectives.bapo import bound_schedule, contributions
from vcpo.objectives.vespo import vespo_kernel

from conftest import LN2, make_inputs

F64 = torch.float64
NAMES = ("vespo", "bapo", "tb", "vcpo")


def t(x):
    return torch.tensor(x, dtype=F64)


# ---------------------------------------------------------------- vespo
def test_vespo_kernel_unit_peak_and_hand_values():
    # phi(1) = 1^k * e^0 = 1 for any (k, lambda).
    for k, lam in ((2.0, 3.0), (3.0, 2.0)):
        assert vespo_kernel(t(0.0), k, lam).item() == pytest.approx(1.0)
    # phi(2; k=2, lam=3) = 4 e^-3 ; phi(0.5; k=3, lam=2) = e/8 ; peak phi(2/3; 2, 3) = (4/9) e^1.
    assert vespo_kernel(t(LN2), 2.0, 3.0).item() == pytest.approx(4 * math.exp(-3))
    assert vespo_kernel(t(-LN2), 3.0, 2.0).item() == pytest.approx(math.e / 8)
    assert vespo_kernel(t(math.log(2 / 3)), 2.0, 3.0).item() == pytest.approx(4 / 9 * math.e)
    # The peak is at W = k/lambda: d phi / dW vanishes there and neighbours are lower.
    for k, lam in ((2.0, 3.0), (3.0, 2.0)):
        w = t(k / lam).requires_grad_()
        vespo_kernel(torch.log(w), k, lam).backward()
        assert abs(w.grad.item()) < 1e-12
        peak = vespo_kernel(t(math.log(k / lam)), k, lam)
        for f in (0.9, 1.1):
            assert vespo_kernel(t(math.log(f * k / lam)), k, lam) < peak
    # logW = +-1000 is clamped to +-20: exp(40 - 3(e^20 - 1)) underflows to 0 ; exp(-40 + 3(1 - e^-20)) = e^-37.
    phi = vespo_kernel(t([1000.0, -1000.0]), 2.0, 3.0)
    assert phi[0].item() == 0.0 and phi[1].item() == pytest.approx(math.exp(-37), rel=1e-9)
    assert vespo_kernel(t(float("nan")), 2.0, 3.0).item() == 0.0


def test_vespo_hand_values_gradient_and_metrics():
    # row 0: d = [ln2, 0] -> W = 2, A = +1 -> phi = 4e^-3 ; row 1: d = [-ln2, 0] -> W = 1/2, A = -1 -> phi = e/8.
    inp, lp = make_inputs([[LN2, -1.0], [-1.0, -2.0]], [[0.0, -1.0], [-1.0 + LN2, -2.0]], [1.0, -1.0])
    out = get_objective("vespo")(inp)
    p0, p1 = 4 * math.exp(-3), math.e / 8
    # token-mean of l = -phi*A*lp: row 0 -p0*(ln2 - 1), row 1 -p1*(-1)*(-1 - 2) = -3 p1; over 4 tokens.
    assert out.loss.item() == pytest.approx((-p0 * (LN2 - 1) - 3 * p1) / 4)
    out.loss.backward()
    # d/dlp = -phi_i * A_i / 4 (phi detached).
    torch.testing.assert_close(lp.grad, t([[-p0 / 4, -p0 / 4], [p1 / 4, p1 / 4]]))
    m = out.metrics
    assert m["vespo/phi_mean_pos"] == pytest.approx(p0) and m["vespo/phi_max_pos"] == pytest.approx(p0)
    assert m["vespo/phi_mean_neg"] == pytest.approx(p1) and m["vespo/phi_max_neg"] == pytest.approx(p1)
    assert m["vespo/logw_mean_pos"] == pytest.approx(LN2) and m["vespo/logw_mean_neg"] == pytest.approx(-LN2)
    # Only positive advantages (A = 0 counts as positive): the negative metrics read 0.
    inp2, _ = make_inputs([[0.0]], [[0.0]], [0.0])
    m2 = get_objective("vespo")(inp2).metrics
    assert m2["vespo/phi_mean_pos"] == 1.0 and m2["vespo/phi_max_neg"] == 0.0 and m2["vespo/logw_mean_neg"] == 0.0


def test_vespo_per_token_advantage_sign():
    # [B, T] advantages: one row with W = 2 and A = [+1, -1] takes phi per token:
    # token 0 (k=2, lam=3): 4e^-3 ; token 1 (k=3, lam=2): 8 e^-2. Gradient -phi*A/2.
    inp, lp = make_inputs([[LN2, 0.0]], [[0.0, 0.0]], [[1.0, -1.0]])
    get_objective("vespo")(inp).loss.backward()
    torch.testing.assert_close(lp.grad, t([[-4 * math.exp(-3) / 2, 8 * math.exp(-2) / 2]]))


# ---------------------------------------------------------------- bapo
def test_bapo_bounds_move_by_hand():
    # Three one-token rows, r = [2, 1, 0.5], A = [+1, -1, -0.6].
    # P(c_hi) = min(2, c_hi) * 1 ; N(c_lo) = max(1, c_lo) * 1 + max(0.5, c_lo) * 0.6.
    # start (0.6, 1.2): P/N = 1.2 / 1.36 < 1. c_lo 0.65..0.8 only raises N (to 1.48 at 0.8).
    # c_hi 1.25 .. 1.45 gives P <= 1.45 < 1.48 ; c_hi = 1.5 gives P = 1.5 >= 1.48: chosen (0.8, 1.5).
    inp, lp = make_inputs([[LN2], [0.0], [-LN2]], [[0.0], [0.0], [0.0]], [1.0, -1.0, -0.6])
    out = get_objective("bapo")(inp)
    m = out.metrics
    assert m["bapo/c_low"] == pytest.approx(0.8) and m["bapo/c_high"] == pytest.approx(1.5)
    assert m["bapo/pos_neg_ratio"] == pytest.approx(1.5 / 1.48)
    # Loss at (0.8, 1.5): row 0 max(-2, -1.5) = -1.5 (clipped) ; row 1 max(1, 1) = 1 (dual-clip 3 inactive) ;
    # row 2 max(0.3, 0.6*0.8 = 0.48) = 0.48 (clipped). token-mean: (-1.5 + 1 + 0.48) / 3.
    assert out.loss.item() == pytest.approx(-0.02 / 3)
    out.loss.backward()
    # Only row 1 is unclipped: d(-A r)/dlp = -A r / 3 = 1/3.
    torch.testing.assert_close(lp.grad, t([[0.0], [1 / 3], [0.0]]))
    assert m["clip/frac"] == pytest.approx(2 / 3) and m["clip/frac_high"] == pytest.approx(1 / 3)
    assert m["clip/frac_dual"] == 0.0


def test_bapo_stateless_saturation_and_no_negatives():
    # P = 0.1, N = 1 for every candidate: the search ends at both maxima (0.8, 2.0).
    inp, _ = make_inputs([[0.0], [0.0]], [[0.0], [0.0]], [0.1, -1.0])
    m = get_objective("bapo")(inp).metrics
    assert (m["bapo/c_low"], m["bapo/c_high"]) == (pytest.approx(0.8), pytest.approx(2.0))
    assert m["bapo/pos_neg_ratio"] == pytest.approx(0.1)
    # A later balanced call starts again from (0.6, 1.2): no state is carried between calls.
    inp2, _ = make_inputs([[0.0], [0.0]], [[0.0], [0.0]], [1.0, -1.0])
    m2 = get_objective("bapo")(inp2).metrics
    assert (m2["bapo/c_low"], m2["bapo/c_high"], m2["bapo/pos_neg_ratio"]) == (0.6, 1.2, 1.0)
    # No negative advantage: N = 0 meets any target at the start; the ratio is reported capped.
    inp3, _ = make_inputs([[0.0]], [[0.0]], [1.0])
    m3 = get_objective("bapo")(inp3).metrics
    assert (m3["bapo/c_low"], m3["bapo/c_high"], m3["bapo/pos_neg_ratio"]) == (0.6, 1.2, 1e6)
    assert get_objective("bapo")(make_inputs([[0.0]], [[0.0]], [0.0])[0]).metrics["bapo/pos_neg_ratio"] == 1.0


def test_bapo_separate_steps_the_authors_example():
    # run_bapo_example.sh: c_low 0.8 -> 0.95 by 0.05, c_high 1.2 -> 2.0 by 0.1, target 0.5.
    # Tokens: r = 2 with A = +1, r = 1 with A = -2.68. P = min(2, c_hi) = c_hi, N = max(1, c_lo)*2.68 = 2.68.
    # c_lo 0.8 .. 0.95 keeps P/N = 1.2/2.68 = 0.448 < 0.5; then c_hi 1.3 (0.485), 1.4 (0.522 >= 0.5): stop.
    kwargs = {"target": 0.5, "c_low": 0.8, "c_low_max": 0.95}

    def batch():
        return make_inputs([[LN2], [0.0]], [[0.0], [0.0]], [1.0, -2.68])

    inp, lp = batch()
    out = get_objective("bapo")(inp, **kwargs, step_low=0.05, step_high=0.1)
    m = out.metrics
    assert (m["bapo/c_low"], m["bapo/c_high"]) == (pytest.approx(0.95), pytest.approx(1.4))
    assert m["bapo/pos_neg_ratio"] == pytest.approx(1.4 / 2.68)
    # l = max(-A*r, -A*clip(r, .95, 1.4)): [max(-2, -1.4), max(2.68, 2.68)] = [-1.4, 2.68]; token-mean 0.64.
    assert out.loss.item() == pytest.approx(0.64)
    out.loss.backward()
    # The positive token is clipped (zero gradient); the negative one gets -A*r/2 = 1.34.
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0], [1.34]], dtype=F64))
    # One step of 0.05 for both stops one notch earlier, at c_hi = 1.35 (1.35/2.68 = 0.504).
    m05 = get_objective("bapo")(batch()[0], **kwargs).metrics
    assert m05["bapo/c_high"] == pytest.approx(1.35)
    # step is the shortcut for both: step=0.1 visits lows 0.8, 0.9, 0.95 and highs 1.3, 1.4.
    m10 = get_objective("bapo")(batch()[0], **kwargs, step=0.1).metrics
    assert (m10["bapo/c_low"], m10["bapo/c_high"]) == (pytest.approx(0.95), pytest.approx(1.4))
    # The schedule: 4 lows (0.8, .85, .9, .95) then 8 highs (1.3 .. 2.0): 12 pairs.
    lo_K, hi_K = bound_schedule(0.8, 0.95, 1.2, 2.0, 0.05, 0.1)
    assert len(lo_K) == 12 and hi_K[3].item() == 1.2 and hi_K[4].item() == pytest.approx(1.3)
    assert lo_K[3].item() == pytest.approx(0.95) and hi_K[-1].item() == pytest.approx(2.0)


def test_bapo_schedule_and_contributions_match_brute_force():
    lo_K, hi_K = bound_schedule(0.6, 0.8, 1.2, 2.0, 0.05, 0.05)
    # 5 c_low values (0.6 .. 0.8) then 16 more c_high values (1.25 .. 2.0): 21 pairs.
    assert len(lo_K) == 21 and lo_K[4].item() == pytest.approx(0.8) and hi_K[4].item() == 1.2
    assert lo_K[-1].item() == pytest.approx(0.8) and hi_K[-1].item() == pytest.approx(2.0)
    g = torch.Generator().manual_seed(0)
    r = torch.exp(torch.randn(200, generator=g, dtype=F64) * 0.5)
    r[:5] = 0.7  # exact ties with a candidate bound
    a = torch.randn(200, generator=g, dtype=F64)
    p_K, n_K = contributions(r, a, lo_K, hi_K)
    for k in range(len(lo_K)):
        eff = torch.where(a >= 0, r.clamp(max=hi_K[k]), r.clamp(min=lo_K[k])) * a
        assert p_K[k].item() == pytest.approx(eff.clamp(min=0).sum().item())
        assert n_K[k].item() == pytest.approx((-eff).clamp(min=0).sum().item())


def test_bapo_dual_clip_and_old_logprobs():
    # A = -1, r = e^3: max(e^3, 0.6...) = e^3 ; dual-clip caps at -A*3 = 3 (zero gradient).
    inp, lp = make_inputs([[3.0]], [[0.0]], [-1.0])
    out = get_objective("bapo")(inp)
    assert out.loss.item() == pytest.approx(3.0) and out.metrics["clip/frac_dual"] == 1.0
    out.loss.backward()
    assert lp.grad.abs().max().item() == 0.0
    no_dual = get_objective("bapo")(make_inputs([[3.0]], [[0.0]], [-1.0])[0], dual_clip=None)
    assert no_dual.loss.item() == pytest.approx(math.exp(3.0))
    # old_logprobs given: r = exp(lp - olp) = 1.1, inside [0.6, 1.2], whatever blp is.
    inp2, _ = make_inputs([[math.log(1.1)]], [[-5.0]], [1.0], old_logprobs=[[0.0]])
    assert get_objective("bapo")(inp2).loss.item() == pytest.approx(-1.1)


# ---------------------------------------------------------------- tb
def _tb_batch():
    # beta = 0.5. v_i = R_i/beta + sum reflp - sum lp ; logZ_g = mean_g v ; delta_i = logZ_g - v_i.
    # g=7: row 0 S=-2, Sref=-3, R=1 -> v=1 ; row 1 (one token) S=-0.5, Sref=-0.5, R=0 -> v=0 ; logZ 0.5.
    # g=3: row 2 S=-4, Sref=-4, R=1 -> v=2 ; row 3 S=-2, Sref=-2, R=1.5 -> v=3 ;
    #      row 4 S=-2, Sref=-1, R=0 -> v=1 ; logZ 2.
    # delta = [-0.5, 0.5, 0, -1, 1].
    lp = [[-1.0, -1.0], [-0.5, 9.0], [-3.0, -1.0], [-1.0, -1.0], [-1.5, -0.5]]
    ref = [[-1.0, -2.0], [-0.5, 9.0], [-2.0, -2.0], [-1.0, -1.0], [-0.5, -0.5]]
    mask = [[1, 1], [1, 0], [1, 1], [1, 1], [1, 1]]
    return make_inputs(lp, lp, [0.0] * 5, mask, rewards=[1.0, 0.0, 1.0, 1.5, 0.0],
                       group_ids=[7, 7, 3, 3, 3], ref_logprobs=ref)


def test_tb_hand_values_gradient_metrics():
    inp, lp = _tb_batch()
    out = get_objective("tb")(inp, beta=0.5)
    # mean_i delta^2 = (0.25 + 0.25 + 0 + 1 + 1) / 5 = 0.5
    assert out.loss.item() == pytest.approx(0.5)
    out.loss.backward()
    # d/dlp[i,t] = 2 delta_i m[i,t] / 5 (logZ detached).
    torch.testing.assert_close(lp.grad, t([[-0.2, -0.2], [0.2, 0.0], [0.0, 0.0], [-0.4, -0.4], [0.4, 0.4]]))
    # logZ over counted sequences: (0.5*2 + 2*3) / 5 = 1.4
    assert out.metrics["tb/logz_mean"] == pytest.approx(1.4)
    assert out.metrics["tb/delta_sq_mean"] == pytest.approx(0.5)
    # The other modes broadcast delta^2 to tokens: L = [2, 1, 2, 2, 2], sum_i L_i delta_i^2 = 4.75.
    agg = {"token-mean": 4.75 / 9, "seq-mean-token-sum": 4.75 / 5, "seq-mean-token-sum-norm": 4.75 / (5 * 4)}
    for mode, want in agg.items():
        got = get_objective("tb")(_tb_batch()[0], beta=0.5, loss_agg=mode, max_len=4).loss.item()
        assert got == pytest.approx(want)


def test_tb_defaults_when_optional_inputs_missing():
    # No rewards / group_ids / ref: R := A, one group, no reference term. beta = 1. Row 2 is empty
    # and is no trajectory. S = [-1, -3], v = A - S = [2, 3], logZ = 2.5, delta = [0.5, -0.5], loss 0.25,
    # gradient 2 delta_i / B_eff with B_eff = 2.
    inp, lp = make_inputs([[-1.0], [-3.0], [50.0]], [[0.0]] * 3, [1.0, 0.0, 9.0], [[1], [1], [0]])
    out = get_objective("tb")(inp, beta=1.0)
    assert out.loss.item() == pytest.approx(0.25) and out.metrics["tb/logz_mean"] == pytest.approx(2.5)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, t([[0.5], [-0.5], [0.0]]))
    # [B, T] advantages stand in by their per-sequence mean over counted tokens.
    inp2, _ = make_inputs([[-1.0, 5.0], [-3.0, 5.0]], [[0.0, 0.0]] * 2, [[2.0, 0.0], [0.0, 0.0]], [[1, 1], [1, 0]])
    # row 0: S = 4, R = 1 -> v = -3 ; row 1: S = -3, R = 0 -> v = 3 ; logZ 0 ; delta = [3, -3] ; loss 9.
    assert get_objective("tb")(inp2, beta=1.0).loss.item() == pytest.approx(9.0)


def test_tb_with_reference_equal_to_policy_is_baselined_reinforce():
    # ref == lp (detached) and one group: delta_i = -(R_i - mean R)/beta, so the TB gradient equals
    # REINFORCE's (seq-mean-token-sum) with advantages (2/beta)(R - mean R). TB never reads blp.
    torch.manual_seed(0)
    lp0 = torch.randn(4, 3, dtype=F64) - 1.0
    rew = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64)
    beta = 0.05
    inp, lp = make_inputs(lp0.tolist(), (lp0 + 7).tolist(), [0.0] * 4, rewards=rew, ref_logprobs=lp0.clone())
    get_objective("tb")(inp, beta=beta).loss.backward()
    adv = (2 / beta) * (rew - rew.mean())
    inp_r, lp_r = make_inputs(lp0.tolist(), lp0.tolist(), adv.tolist())
    get_objective("reinforce")(inp_r, loss_agg="seq-mean-token-sum").loss.backward()
    torch.testing.assert_close(lp.grad, lp_r.grad)


# ---------------------------------------------------------------- vcpo
def _vcpo_batch():
    # row 0: logW = ln2 (W = 2), A = 1 ; row 1: logW = 4 ln2 (W = 16, capped at 8), A = -1 ;
    # row 2: one counted token, logW = 0 (W = 1), A = 0.5 (its masked lp of 99 must not count).
    lp = [[-1.0, -2.0], [-0.5, -1.5], [-3.0, 99.0]]
    blp = [[-1.0, -2.0 - LN2], [-0.5 - 4 * LN2, -1.5], [-3.0, 0.0]]
    return make_inputs(lp, blp, [1.0, -1.0, 0.5], [[1, 1], [1, 1], [1, 0]])


def test_vcpo_hand_values_gradient_metrics():
    inp, lp = _vcpo_batch()
    out = get_objective("vcpo")(inp)
    # seq-mean-token-mean of -w*A*lp: row 0 -(2*1*(-3))/2 = 3 ; row 1 -(8*(-1)*(-2))/2 = -8 ;
    # row 2 -(1*0.5*(-3))/1 = 1.5 ; mean (3 - 8 + 1.5) / 3.
    assert out.loss.item() == pytest.approx(-3.5 / 3)
    out.loss.backward()
    # d/dlp = -w_i A_i / (L_i * 3): row 0 -1/3 ; row 1 +4/3 ; row 2 -1/6 on its counted token.
    torch.testing.assert_close(lp.grad, t([[-1 / 3, -1 / 3], [4 / 3, 4 / 3], [-1 / 6, 0.0]]))
    m = out.metrics
    assert m["clip/frac"] == pytest.approx(1 / 3) and m["vcpo/weight_max"] == pytest.approx(8.0)
    assert m["vcpo/weight_mean"] == pytest.approx(11 / 3)
    # Clipped weights [2, 8, 1]: ESS = 11^2 / 69 ; unclipped [2, 16, 1]: ESS = 19^2 / 261 (registry).
    assert m["ess/ratio_clipped"] == pytest.approx(121 / 69 / 3)
    assert m["ess/ratio"] == pytest.approx(361 / 261 / 3)


def test_vcpo_cap_in_log_space_and_empty_metrics():
    # logW = +1000 -> weight exactly cap ; -1000 -> e^-20 (clamped) ; cap = 2 moves the threshold.
    inp, lp = make_inputs([[1000.0], [-1000.0]], [[0.0], [0.0]], [1.0, 1.0])
    out = get_objective("vcpo")(inp, cap=2.0)
    assert out.metrics["vcpo/weight_max"] == 2.0 and out.metrics["clip/frac"] == 0.5
    out.loss.backward()
    assert lp.grad[0, 0].item() == pytest.approx(-2.0 / 2)
    assert lp.grad[1, 0].item() == pytest.approx(-math.exp(-20) / 2, rel=1e-9)
    m2 = get_objective("vcpo")(make_inputs([[0.0]], [[0.0]], [1.0], [[0]])[0]).metrics
    assert m2["clip/frac"] == 0.0 and "ess/ratio_clipped" not in m2


# ---------------------------------------------------------------- shared properties
@pytest.mark.parametrize("name", ("vespo", "bapo", "vcpo"))
def test_on_policy_gradient_equals_reinforce(name):
    # lp == blp: W = 1 so phi(1) = 1 and min(1, cap) = 1 ; r = 1 lies inside BAPO's bounds.
    torch.manual_seed(1)
    lp0 = torch.randn(4, 5, dtype=F64) - 1.0
    adv = torch.randn(4, dtype=F64)
    mask = (torch.rand(4, 5) > 0.3).double().tolist()
    grads = []
    for obj in ("reinforce", name):
        inp, lp = make_inputs(lp0.tolist(), lp0.tolist(), adv.tolist(), mask)
        get_objective(obj)(inp, loss_agg="seq-mean-token-mean").loss.backward()
        grads.append(lp.grad)
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_every_loss_agg_mode(name, mode):
    inp, lp = _vcpo_batch()
    inp = type(inp)(inp.logprobs, inp.behavior_logprobs, inp.advantages, inp.mask,
                    rewards=t([1.0, 0.0, 1.0]), group_ids=torch.tensor([0, 0, 1]))
    out = get_objective(name)(inp, loss_agg=mode, max_len=4)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all()
    if name == "vcpo":  # weights [2, 8, 1]: the per-token loss is -w*A*lp under every mode
        want = aggregate(-t([[2.0], [8.0], [1.0]]) * t([[1.0], [-1.0], [0.5]]) * inp.logprobs.detach(),
                         inp.mask, mode, 4)
        assert out.loss.item() == pytest.approx(want.item())


@pytest.mark.parametrize("name", NAMES)
def test_finite_for_extreme_log_ratios_and_empty_rows(name):
    lp = [[1000.0, -1000.0], [-1000.0, 0.0], [0.0, float("nan")]]
    blp = [[-1000.0, 1000.0], [1000.0, 0.0], [0.0, 0.0]]
    inp, lp_t = make_inputs(lp, blp, [1.0, -1.0, 2.0], [[1, 1], [1, 1], [0, 0]],
                            rewards=[1.0, 0.0, 1.0], ref_logprobs=[[0.0, 0.0]] * 3)
    out = get_objective(name)(inp)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(lp_t.grad).all()
    assert all(math.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize(
    ("name", "kwargs", "pattern"),
    [
        ("vespo", {"k_pos": -1.0}, "k_pos"), ("vespo", {"lambda_pos": 0.0}, "lambda_pos"),
        ("vespo", {"k_neg": float("nan")}, "k_neg"), ("vespo", {"lambda_neg": -2.0}, "lambda_neg"),
        ("bapo", {"target": 0.0}, "target"), ("bapo", {"c_low": 0.0}, "c_low"), ("bapo", {"step": 0.0}, "step"),
        ("bapo", {"c_low_max": 0.5}, "c_low_max"), ("bapo", {"c_high": 0.9}, "c_high"), ("tb", {"beta": 0.0}, "beta"),
        ("bapo", {"c_high_max": 1.1}, "c_high_max"), ("bapo", {"step": 1e-7}, "step"), ("vcpo", {"cap": 0.0}, "cap"),
        ("bapo", {"dual_clip": 0.5}, "dual_clip"), ("vcpo", {"cap": -8.0}, "cap"),
        ("bapo", {"step_low": 0.0}, "step_low"), ("bapo", {"step_high": -0.1}, "step_high"),
        ("bapo", {"step_high": 1e-7}, "step_high"), ("bapo", {"step": 0.1, "step_low": 0.05}, "not both"),
        ("bapo", {"step": 0.1, "step_high": 0.05}, "not both"),
    ],
)
def test_bad_hyperparameters_raise(name, kwargs, pattern):
    inp, _ = make_inputs([[0.0]], [[0.0]], [1.0])
    with pytest.raises(ValueError, match=pattern):
        get_objective(name)(inp, **kwargs)
