"""Properties every registered objective must have, checked with hypothesis over extreme inputs:
finite loss and gradients for log-ratios up to +-1000, all-zero mask rows, single-token sequences;
every loss aggregation mode; and the on-policy reduction of IS-corrected objectives to REINFORCE."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vcpo.objectives import LOSS_AGG_MODES, ObjectiveInputs, get_objective, list_objectives

ALL = list_objectives()
FINITE = st.floats(min_value=-1000.0, max_value=1000.0, allow_nan=False, allow_infinity=False)


def _inputs(data, B: int, T: int, dtype=torch.float64) -> tuple[ObjectiveInputs, torch.Tensor]:
    values = lambda n, s=FINITE: torch.tensor(data.draw(st.lists(s, min_size=n, max_size=n)), dtype=dtype)  # noqa: E731
    lp_BT = (-values(B * T, st.floats(0.0, 50.0)).reshape(B, T)).requires_grad_()
    blp_BT = lp_BT.detach() - values(B * T).reshape(B, T)  # log-ratios anywhere in [-1000, 1000]
    mask_BT = torch.tensor(data.draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))).reshape(B, T)
    mask_BT[0] = False  # always one all-zero row
    inp = ObjectiveInputs(
        logprobs=lp_BT, behavior_logprobs=blp_BT, advantages=values(B, st.floats(-5.0, 5.0)), mask=mask_BT,
        old_logprobs=None, rewards=values(B, st.floats(-1.0, 1.0)),
        group_ids=torch.arange(B) // 2, ref_logprobs=lp_BT.detach() - values(B * T, st.floats(-5, 5)).reshape(B, T),
    )
    return inp, lp_BT


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=25, deadline=None)
@given(data=st.data(), B=st.integers(1, 4), T=st.integers(1, 4))
def test_finite_loss_and_grad_for_extreme_inputs(name, data, B, T):
    inp, lp = _inputs(data, B, T)
    out = get_objective(name)(inp)
    assert out.loss.dim() == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[0].abs().max() == 0  # the all-zero mask row contributes nothing
    assert all(isinstance(v, float) for v in out.metrics.values())


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
def test_every_loss_agg_mode_on_single_token_sequences(name, loss_agg):
    torch.manual_seed(0)
    lp = (torch.randn(4, 1, dtype=torch.float64) - 1).requires_grad_()
    inp = ObjectiveInputs(logprobs=lp, behavior_logprobs=lp.detach() + 0.1 * torch.randn(4, 1, dtype=torch.float64),
                          advantages=torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64),
                          mask=torch.ones(4, 1), rewards=torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64),
                          group_ids=torch.tensor([0, 0, 1, 1]))
    kwargs = {"max_len": 4} if loss_agg == "seq-mean-token-sum-norm" else {}
    out = get_objective(name)(inp, loss_agg=loss_agg, **kwargs)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(lp.grad).all() and lp.grad.abs().sum() > 0


# With mu = pi (and no proximal policy) the importance weight is 1, so these give the REINFORCE
# gradient -A * grad lp under the same aggregation. tb and topr have other estimators by design.
ON_POLICY_EQUALS_REINFORCE = ["reinforce", "ppo_clip", "grpo", "gspo", "gspo_token", "gmpo", "sapo", "cispo",
                              "tis", "mis", "icepop", "m2po", "vespo", "bapo", "vcpo"]


@pytest.mark.parametrize("name", ON_POLICY_EQUALS_REINFORCE)
def test_on_policy_gradient_is_reinforce(name):
    torch.manual_seed(1)
    lp0 = torch.randn(6, 5, dtype=torch.float64) - 1.0
    adv = torch.randn(6, dtype=torch.float64)
    mask = torch.rand(6, 5) > 0.2
    grads = []
    for n in ("reinforce", name):
        lp = lp0.clone().requires_grad_()
        inp = ObjectiveInputs(logprobs=lp, behavior_logprobs=lp0.clone(), advantages=adv, mask=mask)
        get_objective(n)(inp, loss_agg="seq-mean-token-mean").loss.backward()
        grads.append(lp.grad)
    torch.testing.assert_close(grads[1], grads[0])


def test_required_objectives_registered():
    required = {"reinforce", "ppo_clip", "grpo", "gspo", "gspo_token", "gmpo", "sapo", "cispo", "tis", "mis",
                "icepop", "m2po", "vespo", "bapo", "topr", "tb", "vcpo"}
    assert required <= set(ALL)
