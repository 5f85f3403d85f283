"""The learner: fast OPOB (one batched backward) gives the exact path's gradients, for an objective
whose gradient is one coefficient per row (assembled, no second backward) and for one that is not, and
autograd's gradient of the loss with ``opob_advantages``, for every OPOB variant; the ESS-scaled learning
rate is set for the step and restored."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from vcpo.config import load_config
from vcpo.objectives import ObjectiveInputs, get_objective
from vcpo.train.learner import Learner
from vcpo.types import Batch, SamplingParams, Trajectory
from vcpo.variance import OPOB_VARIANTS, opob_advantages, sequence_log_weights, token_logprobs, trajectory_grad_sq_norms


def tiny_llama(tie: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg).eval()


def batch(seed: int = 0, stale: float = 0.5, rewards: list[float] | None = None) -> Batch:
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(8):  # 2 groups of 4, prompts and responses of varied lengths
        p = torch.randint(3, 40, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        r = torch.randint(3, 40, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
        blp = (-torch.rand(len(r), generator=g) * 3 - stale * torch.rand(len(r), generator=g)).tolist()
        reward = float(torch.rand(1, generator=g) > 0.5) if rewards is None else rewards[i]
        trajs.append(Trajectory("u", i // 4, p, r, blp, [0] * len(r), reward, True, SamplingParams()))
    return Batch.from_trajectories(trajs, pad_id=0)


def grads(objective: str, method: str, tie: bool, extra: list[str] = ()) -> tuple[list[torch.Tensor], dict]:
    cfg = load_config(None, [f"objective.name={objective}", "advantage.estimator=opob",
                             f"advantage.grad_norm_method={method}", *extra])
    model = tiny_llama(tie)
    learner = Learner(copy.deepcopy(model), cfg)
    metrics = learner.backward(batch())
    return [p.grad.clone() for p in learner.params], metrics


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize(("objective", "second_backward"), [("vcpo", 0.0), ("reinforce", 0.0), ("ppo_clip", 1.0)])
@pytest.mark.parametrize("variant", OPOB_VARIANTS)
def test_fast_opob_gradients_equal_exact(objective, second_backward, tie, variant):
    exact, m_exact = grads(objective, "exact", tie, [f"advantage.opob_variant={variant}"])
    fast, m_fast = grads(objective, "fast", tie, [f"advantage.opob_variant={variant}"])
    assert m_fast["opob/second_backward"] == second_backward
    assert m_fast["opob/grad_sq_norm_mean"] == pytest.approx(m_exact["opob/grad_sq_norm_mean"], rel=1e-4)
    for ge, gf in zip(exact, fast, strict=True):
        torch.testing.assert_close(gf, ge, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("weighting", ["paper", "authors_code"])
@pytest.mark.parametrize("variant", OPOB_VARIANTS)
def test_single_backward_equals_autograd_of_the_loss_with_opob_advantages(variant, weighting):
    # Independent of the learner's plumbing: G exact per row, advantages from the public function, the vcpo
    # objective's loss, torch.autograd; against the fast path's one backward (assembled, no second backward).
    fast, m_fast = grads("vcpo", "fast", True, [f"advantage.opob_variant={variant}",
                                                f"advantage.opob_weighting={weighting}"])
    assert m_fast["opob/second_backward"] == 0.0
    model, b = tiny_llama(True), batch()
    lp_BS = token_logprobs(model, b.input_ids_BS, b.attention_mask_BS)
    G_B = trajectory_grad_sq_norms(model, b.input_ids_BS, b.response_mask_BS, b.attention_mask_BS)
    logw_B = sequence_log_weights(lp_BS, b.behavior_logprobs_BS, b.response_mask_BS)
    adv_B = opob_advantages(b.rewards_B, logw_B, G_B, b.group_ids_B, weighting=weighting, variant=variant)
    loss = get_objective("vcpo")(ObjectiveInputs(logprobs=lp_BS, behavior_logprobs=b.behavior_logprobs_BS,
                                                 advantages=adv_B, mask=b.response_mask_BS)).loss
    reference = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    for gr, gf in zip(reference, fast, strict=True):
        torch.testing.assert_close(gf, gr, rtol=1e-4, atol=1e-7)


def test_the_variants_give_different_gradients():
    plugin, _ = grads("vcpo", "fast", True, ["advantage.opob_variant=plugin"])
    for variant in ("leave_one_out", "grad_only"):
        other, _ = grads("vcpo", "fast", True, [f"advantage.opob_variant={variant}"])
        assert max(float((a - b).abs().max()) for a, b in zip(plugin, other, strict=True)) > 1e-4


@pytest.mark.parametrize("method", ["fast", "exact"])
def test_equal_reward_groups_skip_their_norms_and_the_gradient_is_unchanged(method, monkeypatch):
    import vcpo.train.learner

    cfg = load_config(None, ["objective.name=vcpo", "advantage.estimator=opob", f"advantage.grad_norm_method={method}"])
    b = batch(rewards=[1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0])  # group 0 all equal: its rows need no G
    skipping = Learner(tiny_llama(), cfg)
    m_skip = skipping.backward(b)
    monkeypatch.setattr(
        vcpo.train.learner, "opob_rows_needing_grad_norms", lambda r, g: torch.ones_like(r, dtype=torch.bool)
    )
    full = Learner(tiny_llama(), cfg)
    m_full = full.backward(b)
    assert m_skip["opob/grad_norm_rows_frac"] == 0.5 and m_full["opob/grad_norm_rows_frac"] == 1.0
    assert m_skip["adv/abs_mean"] == m_full["adv/abs_mean"]
    for gs, gf in zip(skipping.params, full.params, strict=True):
        torch.testing.assert_close(gs.grad, gf.grad, rtol=1e-6, atol=1e-9)


def test_ess_scaled_lr_is_set_for_the_step_and_restored():
    cfg = load_config(None, ["objective.name=vcpo", "advantage.estimator=grpo", "trainer.lr=0.01",
                             "trainer.ess_lr.rule=linear"])
    learner = Learner(tiny_llama(), cfg)
    b = batch(stale=3.0)
    metrics = learner.step(b)
    rho = metrics["ess/ratio"]
    assert rho < 0.99  # stale data: the weights are uneven
    assert metrics["lr"] == pytest.approx(0.01 * rho) and metrics["lr_scale"] == pytest.approx(rho)
    assert all(g["lr"] == 0.01 for g in learner.optimizer.param_groups)
    assert learner.version == 1
