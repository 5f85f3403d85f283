"""The logit proxy of OPOB's G: by hand on one token, against autograd's gradient with respect to the logits on
a tiny Llama (full and lean log-prob paths, a temperature), and in the learner (no extra backward, the gradient
of the loss with ``opob_advantages`` on the proxy)."""

from __future__ import annotations

import math

import pytest
import torch

from test_learner import batch, tiny_llama
from vcpo.config import load_config
from vcpo.objectives import ObjectiveInputs, get_objective
from vcpo.train.learner import Learner
from vcpo.variance import logit_proxy_grad_sq_norms, logprobs, opob_advantages, sequence_log_weights, token_logprobs
from vcpo.variance.logprobs import logprobs_from_logits


def test_one_token_by_hand():
    # Logits [0, 0, ln 2] -> pi = [1/4, 1/4, 1/2]; the token is y = 2.
    # 1 - 2 * 1/2 + (1/16 + 1/16 + 1/4) = 3/8 = (1 - 1/2)^2 + 1/16 + 1/16. At T = 2: the same over T^2 = 4 for
    # logits [0, 0, 2 ln 2] (the tempered distribution is the same): 3/32.
    ids = torch.tensor([[0, 2]])
    logits = torch.tensor([[[0.0, 0.0, math.log(2.0)], [0.0, 0.0, 0.0]]], dtype=torch.float64)
    lp, _, collision = logprobs_from_logits(logits, ids, return_collision=True)
    assert collision[0, 1].item() == pytest.approx(1 / 16 + 1 / 16 + 1 / 4)
    mask = torch.tensor([[1, 1]])  # position 0 is ignored
    assert logit_proxy_grad_sq_norms(lp, collision, mask).item() == pytest.approx(3 / 8)
    lp2, _, collision2 = logprobs_from_logits(2 * logits, ids, temperature=2.0, return_collision=True)
    assert logit_proxy_grad_sq_norms(lp2, collision2, mask, temperature=2.0).item() == pytest.approx(3 / 32)
    with pytest.raises(ValueError, match="temperature"):
        logit_proxy_grad_sq_norms(lp, collision, mask, temperature=0.0)


def _autograd_logit_sq_norms(model, b, temperature: float) -> torch.Tensor:
    """Per row: || d/d logits sum_t m_t log softmax(logits_{t-1} / T)[y_t] ||^2, one autograd call per row."""
    logits = model(input_ids=b.input_ids_BS, attention_mask=b.attention_mask_BS, use_cache=False).logits.double()
    norms = []
    for row in range(b.input_ids_BS.shape[0]):
        lp = logprobs_from_logits(logits[row : row + 1], b.input_ids_BS[row : row + 1], temperature)
        score = torch.where(b.response_mask_BS[row : row + 1, 1:].bool(), lp[:, 1:], torch.zeros_like(lp[:, 1:])).sum()
        (g,) = torch.autograd.grad(score, logits, retain_graph=True)
        norms.append(g.square().sum())
    return torch.stack(norms)


@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_proxy_equals_the_logit_gradient_norm_of_autograd(lean, temperature, monkeypatch):
    if lean:  # every batch takes the chunked lean path
        monkeypatch.setattr(logprobs, "LEAN_MIN_LOGITS", 0)
        monkeypatch.setattr(logprobs, "CHUNK_LOGITS", 40 * 5)  # chunks of 5 tokens
    model, b = tiny_llama(), batch()
    with torch.no_grad():
        lp, entropy, collision = token_logprobs(model, b.input_ids_BS, b.attention_mask_BS, temperature,
                                                positions=b.response_mask_BS, return_collision=True)
        plain_lp, plain_entropy = token_logprobs(model, b.input_ids_BS, b.attention_mask_BS, temperature,
                                                 return_entropy=True, positions=b.response_mask_BS)
    assert torch.equal(lp, plain_lp) and torch.equal(entropy, plain_entropy)  # the extra output changes nothing
    proxy = logit_proxy_grad_sq_norms(lp, collision, b.response_mask_BS, temperature)
    torch.testing.assert_close(proxy, _autograd_logit_sq_norms(model, b, temperature), rtol=1e-5, atol=1e-7)
    assert (proxy > 0).all()


def test_learner_with_the_proxy_equals_autograd_of_the_loss_with_opob_advantages():
    cfg = load_config(None, ["objective.name=vcpo", "advantage.estimator=opob",
                             "advantage.grad_norm_method=logit_proxy", "advantage.opob_variant=leave_one_out"])
    b = batch()
    learner = Learner(tiny_llama(), cfg)
    metrics = learner.backward(b)
    assert "opob/second_backward" not in metrics and "time/grad_norms_s" not in metrics  # no backward for G
    model = tiny_llama()
    lp, _, collision = token_logprobs(model, b.input_ids_BS, b.attention_mask_BS, return_collision=True)
    proxy = logit_proxy_grad_sq_norms(lp, collision, b.response_mask_BS)
    logw = sequence_log_weights(lp, b.behavior_logprobs_BS, b.response_mask_BS)
    adv = opob_advantages(b.rewards_B, logw, proxy, b.group_ids_B, variant="leave_one_out")
    loss = get_objective("vcpo")(ObjectiveInputs(logprobs=lp, behavior_logprobs=b.behavior_logprobs_BS,
                                                 advantages=adv, mask=b.response_mask_BS)).loss
    reference = torch.autograd.grad(loss, list(model.parameters()))
    for gr, p in zip(reference, learner.params, strict=True):
        torch.testing.assert_close(p.grad, gr, rtol=1e-5, atol=1e-8)
    assert metrics["opob/grad_sq_norm_mean"] == pytest.approx(float(proxy.mean()))  # every group is mixed here
    assert metrics["opob/grad_norm_rows_frac"] == 1.0
