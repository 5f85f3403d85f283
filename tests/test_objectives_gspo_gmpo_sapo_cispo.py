"""gspo, gspo_token, gmpo, sapo and cispo: hand-worked values, closed-form gradients, invariants."""

from __future__ import annotations

import math

import pytest
import torch

from vcpo.objectives import LOSS_AGG_MODES, aggregate, get_objective, objective_hyperparameters

from conftest import LN2, make_inputs

NAMES = ("gspo", "gspo_token", "gmpo", "sapo", "cispo")
SIGMA1 = 1.0 / (1.0 + math.exp(-1.0))  # sigmoid(1)


def _random_batch(seed: int, noise: float):
    """4 rows x 5 tokens, ragged mask (row 3 has 2 tokens), per-sequence advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(4, 5, generator=g, dtype=torch.float64) * 3
    blp = lp + noise * torch.randn(4, 5, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.5, -0.7, 0.4, -2.0], dtype=torch.float64)
    mask = torch.ones(4, 5, dtype=torch.float64)
    mask[3, 2:] = 0.0
    return make_inputs(lp.tolist(), blp.tolist(), adv.tolist(), mask.tolist())


def _grad(name: str, inp, lp, **hp) -> torch.Tensor:
    out = get_objective(name)(inp, **hp)
    out.loss.backward()
    return lp.grad


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_hand_values(name):
    # blp = 0, so log s_i = mean of counted lp; eps 3e-4 / 4e-4 -> band [0.9997, 1.0004].
    # row 0: log s = 2e-4, s = e^2e-4 ~ 1.0002 inside the band: l0 = -s0, unclipped.
    # row 1: log s = 1e-3, s ~ 1.0010 > 1.0004 with A = +1: clipped high, l1 = -1.0004, no gradient.
    # row 2: log s = -1e-3 (masked token ignored), s ~ 0.9990 < 0.9997 with A = -2:
    #        clipped low, l2 = max(2*0.9990, 2*0.9997) = 1.9994, no gradient.
    # row 3: log s = (ln2 - ln2)/2 = 0, s = 1, l3 = +1, unclipped.
    # seq-mean-token-mean over B = 4: loss = (l0 + l1 + l2 + l3) / 4.
    inp, lp = make_inputs([[1e-4, 3e-4], [1e-3, 1e-3], [-1e-3, 5.0], [LN2, -LN2]], [[0.0, 0.0]] * 4,
                          [1.0, 1.0, -2.0, -1.0], [[1, 1], [1, 1], [1, 0], [1, 1]])
    out = get_objective(name)(inp)
    s0 = math.exp(2e-4)
    assert out.loss.item() == pytest.approx((-s0 - 1.0004 + 1.9994 + 1.0) / 4, rel=1e-12)
    out.loss.backward()
    # Unclipped rows: d loss / d lp_it = -A_i * s_i / (B * L_i): row 0 -s0/8, row 3 +1/8.
    expected = torch.tensor([[-s0 / 8, -s0 / 8], [0.0, 0.0], [0.0, 0.0], [1 / 8, 1 / 8]], dtype=torch.float64)
    torch.testing.assert_close(lp.grad, expected)
    # 2 of 4 sequences clipped, 1 low and 1 high; gspo/seq_ratio_mean is the mean of the four s_i.
    m = {k: out.metrics[k] for k in ("clip/frac", "clip/frac_low", "clip/frac_high", "gspo/seq_ratio_mean")}
    assert m == pytest.approx({"clip/frac": 0.5, "clip/frac_low": 0.25, "clip/frac_high": 0.25,
                               "gspo/seq_ratio_mean": (s0 + math.exp(1e-3) + math.exp(-1e-3) + 1.0) / 4})


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_gradient_closed_form(name):
    # Unclipped sequence: grad lp_it = -A_i s_i / (B L_i); clipped sequence: 0.
    inp, lp = _random_batch(seed=1, noise=1e-3)
    grad = _grad(name, inp, lp)
    d = (inp.logprobs.detach() - inp.behavior_logprobs) * inp.mask_f
    s = torch.exp(d.sum(1) / inp.lengths)
    a = inp.advantages
    clipped = ((a > 0) & (s > 1 + 4e-4)) | ((a < 0) & (s < 1 - 3e-4))
    assert 0 < int(clipped.sum()) < 4  # the batch exercises both cases
    per_seq = torch.where(clipped, torch.zeros_like(s), -a * s / (4 * inp.lengths))
    torch.testing.assert_close(grad, per_seq.unsqueeze(1) * inp.mask_f)


def test_gspo_token_differs_from_gspo_with_per_token_advantages():
    # One row lp = [0.3, 0.1], blp = 0, A = [1, -3], wide band (nothing clipped): s = e^0.2.
    # Both losses: mean_t(-A_t * s) = (-s + 3s)/2 = s.
    # gspo_token: grad lp_t = -A_t * s / L -> [-s/2, 3s/2].
    # gspo: the loss s * (-sum A)/L = s depends on lp through s only: grad = s * (1/L) = s/2 per token.
    s = math.exp(0.2)
    grads = {}
    for name in ("gspo", "gspo_token"):
        inp, lp = make_inputs([[0.3, 0.1]], [[0.0, 0.0]], [[1.0, -3.0]])
        out = get_objective(name)(inp, eps_low=0.9, eps_high=10.0)
        assert out.loss.item() == pytest.approx(s)
        out.loss.backward()
        grads[name] = lp.grad
    torch.testing.assert_close(grads["gspo_token"], torch.tensor([[-s / 2, 3 * s / 2]], dtype=torch.float64))
    torch.testing.assert_close(grads["gspo"], torch.tensor([[s / 2, s / 2]], dtype=torch.float64))


def test_gspo_uses_old_logprobs_when_given():
    # old_logprobs = lp: s = 1 whatever blp is (blp = -5 would give s = e^5 and clip).
    inp, _ = make_inputs([[-1.0, -2.0]], [[-5.0, -5.0]], [1.0], old_logprobs=[[-1.0, -2.0]])
    out = get_objective("gspo")(inp)
    assert out.loss.item() == pytest.approx(-1.0) and out.metrics["clip/frac"] == 0.0
    assert out.metrics["gspo/seq_ratio_mean"] == pytest.approx(1.0)


def test_gmpo_hand_values_sign_dependent_log_clip():
    # blp = 0, eps 0.4 / 0.4 in log space.
    # row 0, A = +1, d = [0.6, -0.6]: only the top is capped -> [0.4, -0.6], mean -0.1, ratio e^-0.1.
    # row 1, A = -1, d = [-0.6, 0.6, masked]: only the bottom is capped -> [-0.4, 0.6], mean 0.1.
    # l0 = -1 * e^-0.1, l1 = +1 * e^0.1; seq-mean-token-mean: (e^0.1 - e^-0.1)/2 = sinh(0.1).
    inp, lp = make_inputs([[0.6, -0.6, 0.0], [-0.6, 0.6, 9.0]], [[0.0] * 3] * 2, [1.0, -1.0],
                          [[1, 1, 0], [1, 1, 0]])
    out = get_objective("gmpo")(inp)
    assert out.loss.item() == pytest.approx(math.sinh(0.1))
    out.loss.backward()
    # Clipped tokens get 0; the others -A_i * ratio_i / (B * L_i) = -A_i * ratio_i / 4.
    expected = torch.tensor([[0.0, -math.exp(-0.1) / 4, 0.0], [0.0, math.exp(0.1) / 4, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(lp.grad, expected)
    assert out.metrics["clip/frac"] == pytest.approx(2 / 4)
    assert out.metrics["gmpo/seq_ratio_mean"] == pytest.approx(math.cosh(0.1))  # (e^-0.1 + e^0.1)/2


def test_gmpo_gradient_closed_form():
    # grad lp_it = -A_i * ratio_i / (B L_i) on unclipped counted tokens, 0 elsewhere.
    inp, lp = _random_batch(seed=2, noise=0.5)
    grad = _grad("gmpo", inp, lp)
    d = (inp.logprobs.detach() - inp.behavior_logprobs) * inp.mask_f
    a = inp.advantages.unsqueeze(1)
    clipped = ((a > 0) & (d > 0.4)) | ((a < 0) & (d < -0.4))
    assert 0 < int((clipped & inp.mask.bool()).sum()) < int(inp.mask.sum())
    dc = torch.where(a > 0, d.clamp(max=0.4), d.clamp(min=-0.4))
    ratio = torch.exp(dc.sum(1) / inp.lengths)
    expected = (-a.squeeze(1) * ratio / (4 * inp.lengths)).unsqueeze(1) * inp.mask_f * (~clipped)
    torch.testing.assert_close(grad, expected)


def test_gmpo_zero_advantage_is_never_clipped():
    # A = 0: d = [2, -2] is left as is (ratio exp(0) = 1), the loss and its gradient are 0.
    inp, lp = make_inputs([[2.0, -2.0]], [[0.0, 0.0]], [0.0])
    out = get_objective("gmpo")(inp)
    out.loss.backward()
    assert out.loss.item() == 0.0 and lp.grad.abs().max().item() == 0.0
    assert out.metrics["clip/frac"] == 0.0
    assert out.metrics["gmpo/seq_ratio_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize(("adv", "hp"), [(1.0, {}), (-1.0, {}), (1.0, {"tau_pos": 3.0}), (-2.0, {"tau_neg": 0.2})])
def test_sapo_gate_slope_is_one_at_ratio_one(adv, hp):
    # One token, lp = blp = 0 so r = 1: d loss / d lp = -A * g'(1) * r = -A * g'(1); g'(1) must be 1.
    inp, lp = make_inputs([[0.0]], [[0.0]], [adv])
    grad = _grad("sapo", inp, lp, **hp)
    assert (-grad / adv).item() == pytest.approx(1.0)


def test_sapo_hand_values():
    # row 0, A = +1 (tau 1): r = [1, 2] -> sigmoid(0) = 0.5, g = 2; sigmoid(1) = S, g = 4S.
    # row 1, A = -1 (tau 1.05): r = 1 -> g = 0.5 * 4 / 1.05 = 2/1.05; second token masked.
    # l = -g*A: row 0 mean (-2 - 4S)/2, row 1 +2/1.05; seq-mean-token-mean averages the two rows.
    inp, lp = make_inputs([[0.0, LN2], [0.0, 7.0]], [[0.0, 0.0], [0.0, 0.0]], [1.0, -1.0], [[1, 1], [1, 0]])
    out = get_objective("sapo")(inp)
    S = SIGMA1
    assert out.loss.item() == pytest.approx(((-2 - 4 * S) / 2 + 2 / 1.05) / 2)
    out.loss.backward()
    # d l/d lp = -A * 4s(1-s) * r, scaled by 1/(B L_i): row 0 [-1/4, -4S(1-S)*2/4], row 1 [+1/2, 0].
    expected = torch.tensor([[-0.25, -4 * S * (1 - S) * 2 / 4], [0.5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(lp.grad, expected)
    assert out.metrics["sapo/gate_mean"] == pytest.approx((2 + 4 * S + 2 / 1.05) / 3)
    assert out.metrics["sapo/gate_grad_mean"] == pytest.approx((1 + 4 * S * (1 - S) + 1) / 3)


def test_sapo_gradient_closed_form():
    # grad lp_it = -A_i * 4 s (1-s) * r / (B L_i), s = sigmoid(tau (r - 1)), tau by the sign of A.
    inp, lp = _random_batch(seed=3, noise=0.7)
    grad = _grad("sapo", inp, lp, tau_pos=1.0, tau_neg=1.05)
    a = inp.advantages.unsqueeze(1)
    r = torch.exp((inp.logprobs.detach() - inp.behavior_logprobs) * inp.mask_f)
    tau = torch.where(a > 0, 1.0, 1.05).to(torch.float64)
    s = torch.sigmoid(tau * (r - 1))
    expected = -a * 4 * s * (1 - s) * r / (4 * inp.lengths.unsqueeze(1)) * inp.mask_f
    torch.testing.assert_close(grad, expected)


def test_sapo_far_off_policy_gradient_vanishes_smoothly():
    # r = e^3 ~ 20, A = +1, tau = 1: weight 4s(1-s)*r with s = sigmoid(19) is ~2e-7, tiny but not 0.
    inp, lp = make_inputs([[3.0]], [[0.0]], [1.0])
    g = -_grad("sapo", inp, lp).item()
    s = 1 / (1 + math.exp(-(math.exp(3.0) - 1)))
    assert g == pytest.approx(4 * s * (1 - s) * math.exp(3.0))
    assert 0 < g < 1e-6


def test_cispo_hand_values():
    # row 0, A = +1: token 0 lp = -1, blp = -1 - ln5 -> r = 5 > cap 4: w = 4, l = -4*1*(-1) = 4.
    #                token 1 lp = -2, blp = -2 + ln2 -> r = 0.5, no lower clip: w = 0.5, l = 1.
    # row 1, A = -1: token 0 r = 1, l = -1*(-1)*(-0.5) = -0.5; token 1 masked.
    # token-mean over 3 tokens: (4 + 1 - 0.5)/3 = 1.5.
    inp, lp = make_inputs([[-1.0, -2.0], [-0.5, 3.0]], [[-1.0 - math.log(5.0), -2.0 + LN2], [-0.5, 0.0]],
                          [1.0, -1.0], [[1, 1], [1, 0]])
    out = get_objective("cispo")(inp)
    assert out.loss.item() == pytest.approx(1.5)
    out.loss.backward()
    # gradient -w * A / 3 only through lp: [[-4/3, -0.5/3], [1/3, 0]].
    torch.testing.assert_close(lp.grad, torch.tensor([[-4 / 3, -0.5 / 3], [1 / 3, 0.0]], dtype=torch.float64))
    assert out.metrics["clip/frac"] == pytest.approx(1 / 3)


def test_cispo_lower_clip_when_asked():
    # eps_low 0.2: r = 0.5 -> w = 0.8 (truncated), l = -0.8 * 1 * (-2) = 1.6, grad -0.8.
    inp, lp = make_inputs([[-2.0]], [[-2.0 + LN2]], [1.0])
    out = get_objective("cispo")(inp, eps_low=0.2)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(1.6) and lp.grad.item() == pytest.approx(-0.8)
    assert out.metrics["clip/frac"] == 1.0


def test_cispo_gradient_closed_form():
    # grad lp_it = -clip(r_it, 0, 4) * A_i / N, N = counted tokens.
    inp, lp = _random_batch(seed=4, noise=1.5)
    grad = _grad("cispo", inp, lp)
    r = torch.exp((inp.logprobs.detach() - inp.behavior_logprobs) * inp.mask_f)
    assert bool((r > 4).any())
    expected = -r.clamp(0.0, 4.0) * inp.advantages.unsqueeze(1) / inp.mask.sum() * inp.mask_f
    torch.testing.assert_close(grad, expected)


def test_cispo_on_policy_equals_reinforce_value_and_gradient():
    # r = 1: w = 1, so l = -A * lp is exactly the REINFORCE loss (both token-mean by default).
    inp, lp = _random_batch(seed=5, noise=0.0)
    ref, lp_ref = _random_batch(seed=5, noise=0.0)
    out, out_ref = get_objective("cispo")(inp), get_objective("reinforce")(ref)
    assert out.loss.item() == pytest.approx(out_ref.loss.item())
    out.loss.backward()
    out_ref.loss.backward()
    torch.testing.assert_close(lp.grad, lp_ref.grad)


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "gmpo", "sapo"])
def test_on_policy_gradient_equals_reinforce(name):
    # lp == blp: every ratio is 1 and nothing is clipped, so each gradient is -A * grad lp under
    # the objective's default aggregation (seq-mean-token-mean for these four).
    inp, lp = _random_batch(seed=6, noise=0.0)
    ref, lp_ref = _random_batch(seed=6, noise=0.0)
    grad = _grad(name, inp, lp)
    grad_ref = _grad("reinforce", ref, lp_ref, loss_agg="seq-mean-token-mean")
    torch.testing.assert_close(grad, grad_ref)


def _on_policy_token_loss(name: str, inp) -> torch.Tensor:
    """Per-token loss at r = 1 (lp == blp): -A for the clip objectives, -2A/tau for sapo, -A*lp for cispo."""
    a = inp.adv_BT
    if name == "sapo":
        return -a * torch.where(a > 0, 2 / 1.0, 2 / 1.05)
    if name == "cispo":
        return -a * inp.logprobs.detach()
    return -a


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", NAMES)
def test_every_loss_agg_mode(name, mode):
    inp, lp = _random_batch(seed=7, noise=0.0)
    out = get_objective(name)(inp, loss_agg=mode, max_len=5)
    expected = aggregate(_on_policy_token_loss(name, inp), inp.mask, mode, max_len=5)
    assert out.loss.item() == pytest.approx(expected.item())
    out.loss.backward()
    assert torch.isfinite(lp.grad).all()


@pytest.mark.parametrize("name", NAMES)
def test_finite_for_extreme_log_ratios_and_empty_rows(name):
    # log-ratios of +-1000 and a row whose mask is all zero (it gets no gradient).
    blp = [[-1000.0, 999.0], [998.0, -1001.0], [0.0, 0.0]]
    inp, lp = make_inputs([[0.0, -1.0], [-2.0, -1.0], [-1.0, -1.0]], blp, [1.0, -1.0, 2.0], [[1, 1], [1, 1], [0, 0]])
    out = get_objective(name)(inp)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all()
    assert lp.grad[2].abs().max().item() == 0.0
    assert all(math.isfinite(v) for v in out.metrics.values())
    # A batch with no counted token at all: loss 0 and the objective's own metrics 0.
    empty = get_objective(name)(make_inputs([[0.5, 0.1]], [[0.0, 0.0]], [1.0], [[0, 0]])[0])
    assert empty.loss.item() == 0.0
    assert all(v == 0.0 for k, v in empty.metrics.items() if k.startswith(("clip/", "gspo/", "gmpo/", "sapo/")))


@pytest.mark.parametrize(
    ("name", "hp", "bad"),
    [
        ("gspo", {"eps_low": -1e-4}, "eps_low"), ("gspo", {"eps_low": 1.5}, "eps_low"),
        ("gspo_token", {"eps_high": -0.1}, "eps_high"), ("gmpo", {"eps_low": -0.4}, "eps_low"),
        ("gmpo", {"eps_high": float("nan")}, "eps_high"), ("sapo", {"tau_pos": 0.0}, "tau_pos"),
        ("sapo", {"tau_neg": -1.0}, "tau_neg"), ("cispo", {"eps_low": 1.5}, "eps_low"),
        ("cispo", {"eps_high": -0.2}, "eps_high"), ("cispo", {"loss_agg": "mean"}, "loss_agg"),
    ],
)
def test_bad_hyperparameters_are_named(name, hp, bad):
    inp, _ = make_inputs([[0.0]], [[0.0]], [1.0])
    with pytest.raises(ValueError, match=bad):
        get_objective(name)(inp, **hp)


def test_published_defaults():
    seq = {"loss_agg": "seq-mean-token-mean", "max_len": None}
    assert objective_hyperparameters("gspo") == objective_hyperparameters("gspo_token")
    assert objective_hyperparameters("gspo") == seq | {"eps_low": 3e-4, "eps_high": 4e-4}
    assert objective_hyperparameters("gmpo") == seq | {"eps_low": 0.4, "eps_high": 0.4}
    assert objective_hyperparameters("sapo") == seq | {"tau_pos": 1.0, "tau_neg": 1.05}
    assert objective_hyperparameters("cispo") == {"loss_agg": "token-mean", "max_len": None, "eps_low": 1.0,
                                                  "eps_high": 3.0}
