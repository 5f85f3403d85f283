"""reinforce and ppo_clip: hand-worked values, gradients against the closed form, aggregation."""

from __future__ import annotations

import math

import pytest
import torch

from vcpo.objectives import aggregate, get_objective

from conftest import LN2, make_inputs


def test_reinforce_hand_values():
    # lp = [[-1, -2], [-0.5, -3]], A = [2, -1], full mask, token-mean:
    # l = -A*lp = [[2, 4], [-0.5, -3]] -> sum 2.5 over 4 tokens = 0.625.
    inp, lp = make_inputs([[-1.0, -2.0], [-0.5, -3.0]], [[-1.0, -2.0], [-0.5, -3.0]], [2.0, -1.0])
    out = get_objective("reinforce")(inp)
    assert out.loss.item() == pytest.approx(0.625)
    out.loss.backward()
    # d loss / d lp = -A / 4 -> [[-0.5, -0.5], [0.25, 0.25]]
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5, -0.5], [0.25, 0.25]], dtype=torch.float64))


def test_aggregation_modes_hand_values():
    # l = [[1, 2, 3], [4, 0, 0]], mask = [[1, 1, 1], [1, 0, 0]], rows L = [3, 1]
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # token-mean: (1+2+3+4)/4 = 2.5
    assert aggregate(loss, m, "token-mean").item() == pytest.approx(2.5)
    # seq-mean-token-mean: mean(6/3, 4/1) = mean(2, 4) = 3
    assert aggregate(loss, m, "seq-mean-token-mean").item() == pytest.approx(3.0)
    # seq-mean-token-sum: mean(6, 4) = 5
    assert aggregate(loss, m, "seq-mean-token-sum").item() == pytest.approx(5.0)
    # Dr. GRPO: 10 / (B=2 * max_len=5) = 1
    assert aggregate(loss, m, "seq-mean-token-sum-norm", max_len=5).item() == pytest.approx(1.0)


def test_aggregation_empty_row_contributes_nothing():
    # Row 1 is fully masked (and holds nan): seq-mean over the one non-empty row only.
    loss = torch.tensor([[1.0, 3.0], [float("nan"), float("inf")]])
    m = torch.tensor([[1, 1], [0, 0]])
    assert aggregate(loss, m, "seq-mean-token-mean").item() == pytest.approx(2.0)
    assert aggregate(loss, m, "token-mean").item() == pytest.approx(2.0)


def test_aggregation_errors():
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "bogus")
    with pytest.raises(ValueError, match="max_len"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "seq-mean-token-sum-norm")


def test_ppo_clip_hand_values():
    # One row, 3 tokens, A = +1, token ratios r = [2, 1, 0.5] (lp - blp = [ln2, 0, -ln2]).
    # eps 0.2: clip(r) = [1.2, 1, 0.8]; l = max(-r, -clip r) = [-1.2, -1, -0.8] -> mean -1.0.
    # Token 0 is clipped (r > 1.2, A > 0): zero gradient. Token 2 is not (r < 0.8 with A > 0:
    # -0.5 > -0.8 so the unclipped branch wins). Gradient of -r/3 wrt lp is -r/3.
    inp, lp = make_inputs([[LN2, 0.0, -LN2]], [[0.0, 0.0, 0.0]], [1.0])
    out = get_objective("ppo_clip")(inp)
    # max(-2, -1.2) = -1.2 ; max(-1, -1) = -1 ; max(-0.5, -0.8) = -0.5 -> mean = -2.7/3 = -0.9
    assert out.loss.item() == pytest.approx(-0.9)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -1 / 3, -0.5 / 3]], dtype=torch.float64))
    assert out.metrics["clip/frac"] == pytest.approx(1 / 3)
    assert out.metrics["clip/frac_high"] == pytest.approx(1 / 3)


def test_ppo_clip_dual_clip_negative_advantage():
    # A = -1, r = e^3 ~ 20.09: -A*r = 20.09, clip branch -A*1.2 = 1.2, max = 20.09;
    # dual-clip c = 3 caps it at -A*c = 3, with zero gradient.
    inp, lp = make_inputs([[3.0]], [[0.0]], [-1.0])
    out = get_objective("ppo_clip")(inp, dual_clip=3.0)
    assert out.loss.item() == pytest.approx(3.0)
    out.loss.backward()
    assert lp.grad.abs().max().item() == 0.0
    assert out.metrics["clip/frac_dual"] == 1.0
    # Without dual-clip the loss is e^3.
    inp2, _ = make_inputs([[3.0]], [[0.0]], [-1.0])
    assert get_objective("grpo")(inp2).loss.item() == pytest.approx(math.exp(3.0))


def test_ppo_clip_higher_and_old_logprobs():
    # old_logprobs given: r = exp(lp - olp) = exp(ln 1.25) = 1.25 regardless of blp.
    # clip-higher eps_high 0.28: 1.25 < 1.28 -> unclipped, l = -1.25 (A = 1).
    inp, _ = make_inputs([[math.log(1.25)]], [[-5.0]], [1.0], old_logprobs=[[0.0]])
    out = get_objective("ppo_clip")(inp, eps_high=0.28)
    assert out.loss.item() == pytest.approx(-1.25)
    assert out.metrics["clip/frac"] == 0.0


def test_ppo_clip_on_policy_gradient_equals_reinforce():
    # With r = 1 everywhere the PPO gradient is -A * grad lp, the REINFORCE gradient.
    torch.manual_seed(0)
    lp0 = torch.randn(4, 5, dtype=torch.float64) - 1.0
    adv = torch.randn(4, dtype=torch.float64)
    grads = []
    for name in ("reinforce", "ppo_clip"):
        inp, lp = make_inputs(lp0.tolist(), lp0.tolist(), adv.tolist())
        get_objective(name)(inp).loss.backward()
        grads.append(lp.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_shared_behavior_metrics_present():
    inp, _ = make_inputs([[0.0, 0.0], [LN2, 0.0]], [[0.0, 0.0], [0.0, 0.0]], [1.0, 1.0])
    m = get_objective("reinforce")(inp).metrics
    # logW = [0, ln2]: W = [1, 2], ESS = 9/5 = 1.8, ratio 0.9.
    assert m["ess/ratio"] == pytest.approx(0.9)
    assert m["is/logw_max"] == pytest.approx(LN2)
    assert m["is/token_ratio_max"] == pytest.approx(2.0)
    # k1 = mean(-d) = -ln2/4 ; k3 = mean(e^d - 1 - d) = (2 - 1 - ln2)/4
    assert m["kl/k1"] == pytest.approx(-LN2 / 4)
    assert m["kl/k3"] == pytest.approx((1 - LN2) / 4)
    for key in ("is/token_ratio_p50", "is/token_ratio_p90", "is/token_ratio_p99", "is/logw_p50", "loss/value"):
        assert key in m
