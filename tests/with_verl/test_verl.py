"""vcpo inside a real verl 0.9.1 (`make test-verl`, its own environment; skipped where verl is not installed):
the registered policy losses against vcpo's objectives and verl's own PPO loss, verl's global normaliser, ESSAdamW
built by verl's build_optimizer, OPOB on a real DataProto, and both ways verl loads the module."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed here: "
                                "`make test-verl` runs this tier in .venv-verl")

LOADED = "from verl.trainer.ppo.core_algos import get_policy_loss_fn; get_policy_loss_fn('vcpo_vcpo'); print('ok')"


@pytest.fixture
def batch():
    torch.manual_seed(0)
    B, T = 6, 5
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    behaviour = torch.randn(B, T) * 0.3 - 1.0
    current = (behaviour + torch.randn(B, T) * 0.2).requires_grad_()
    advantages = torch.randn(B)[:, None].expand(B, T) * mask
    return behaviour, current, advantages, mask


@pytest.mark.parametrize(("objective", "mode"), [("vcpo", "seq-mean-token-mean"), ("vespo", "token-mean"),
                                                 ("gspo", "seq-mean-token-sum"), ("cispo", "token-mean")])
def test_registered_losses_are_vcpos_objectives(batch, objective, mode):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from vcpo.integrations import verl as vcpo_verl  # noqa: F401  (registers the losses)
    from vcpo.objectives import ObjectiveInputs, get_objective

    behaviour, current, advantages, mask = batch
    loss, metrics = get_policy_loss_fn(f"vcpo_{objective}")(behaviour, current, advantages, mask, mode,
                                                             SimpleNamespace(global_batch_info={}))
    expected = get_objective(objective)(ObjectiveInputs(logprobs=current, behavior_logprobs=behaviour,
                                                        advantages=advantages, mask=mask), loss_agg=mode)
    torch.testing.assert_close(loss, expected.loss)
    assert metrics["actor/vcpo/ess/ratio"] == pytest.approx(expected.metrics["ess/ratio"])


def test_vcpo_ppo_clip_is_verls_vanilla_ppo(batch):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    import vcpo.integrations.verl

    behaviour, current, advantages, mask = batch
    config = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, global_batch_info={},
                             get=lambda key, default=None: 3.0 if key == "clip_ratio_c" else default)
    verls, _ = get_policy_loss_fn("vanilla")(behaviour, current, advantages, mask, "token-mean", config)
    vcpos, _ = vcpo.integrations.verl.policy_loss("ppo_clip", dual_clip=3.0)(
        behaviour, current, advantages, mask, "token-mean", SimpleNamespace(global_batch_info={}))
    torch.testing.assert_close(vcpos, verls)
    (grad_verl,) = torch.autograd.grad(verls, current)
    (grad_vcpo,) = torch.autograd.grad(vcpos, current)
    torch.testing.assert_close(grad_vcpo, grad_verl)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum",
                                  "seq-mean-token-sum-norm"])
def test_verls_global_normaliser_is_honoured(batch, mode):
    """Two micro-batches on each of two ranks: verl's global counts make their losses sum to the whole batch's
    loss, as verl's own agg_loss does for the same per-token losses (REINFORCE: l = -A * lp)."""
    from verl.trainer.ppo.core_algos import agg_loss

    from vcpo.integrations.verl import policy_loss

    behaviour, current, advantages, mask = batch
    loss_fn = policy_loss("reinforce")
    tokens, sequences = mask.sum(), (mask.sum(1) > 0).sum()
    info = {"dp_size": 2, "batch_num_tokens": tokens, "global_batch_size": sequences, "loss_scale_factor": 7}
    config = SimpleNamespace(global_batch_info=info)
    for rows in (slice(0, 2), slice(2, 6)):
        ours, _ = loss_fn(behaviour[rows], current[rows], advantages[rows], mask[rows], mode, config)
        verls = agg_loss(-advantages[rows] * current[rows], mask[rows], mode, **info)
        torch.testing.assert_close(ours, verls.to(ours.dtype))


def test_ess_adamw_from_verls_build_optimizer_scales_the_step_by_the_ess_rule(batch):
    from verl.workers.config import FSDPOptimizerConfig, build_optimizer

    from vcpo.integrations.verl import ESS_WINDOW, ESSAdamW, policy_loss
    from vcpo.variance import ess_lr_scale, ess_ratio, sequence_log_weights

    behaviour, current, advantages, mask = batch
    weights = torch.nn.Parameter(torch.randn(4))
    reference = torch.nn.Parameter(weights.detach().clone())
    config = FSDPOptimizerConfig(lr=0.1, optimizer="ESSAdamW", optimizer_impl="vcpo.integrations.verl",
                                 override_optimizer_config={"ess_lr_rule": "linear"}, weight_decay=0.0)
    optimizer = build_optimizer([weights], config)
    assert isinstance(optimizer, ESSAdamW) and ESS_WINDOW.take().numel() == 0
    policy_loss("vcpo")(behaviour, current, advantages, mask, "seq-mean-token-mean", SimpleNamespace())
    rho = float(ess_ratio(sequence_log_weights(current, behaviour, mask)[mask.sum(1) > 0]))
    assert rho < 0.99
    torch_adamw = torch.optim.AdamW([reference], lr=0.1 * ess_lr_scale(rho, 1.0, "linear"), weight_decay=0.0)
    for p in (weights, reference):
        p.grad = torch.arange(4.0)
    optimizer.step()
    torch_adamw.step()
    torch.testing.assert_close(weights, reference)
    assert optimizer.last_ess_ratio == pytest.approx(rho) and optimizer.param_groups[0]["lr"] == 0.1
    with pytest.warns(RuntimeWarning, match="no vcpo_\\* policy loss recorded"):
        optimizer.step()  # nothing recorded since (e.g. another loss_mode): the full learning rate, and a warning
    assert optimizer.last_lr_scale == 1.0


def test_a_step_verl_skips_leaves_no_log_weights_for_the_next(batch):
    """verl's engine zeroes the gradients instead of stepping when the gradient norm is not finite
    (FSDPEngine.optimizer_step): that step's log-weights must not enter the next step's ESS."""
    from verl.workers.config import FSDPOptimizerConfig, build_optimizer

    from vcpo.integrations.verl import policy_loss
    from vcpo.variance import ess_ratio, sequence_log_weights

    behaviour, current, advantages, mask = batch
    config = FSDPOptimizerConfig(lr=0.1, optimizer="ESSAdamW", optimizer_impl="vcpo.integrations.verl")
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], config)
    loss_fn, info = policy_loss("vcpo"), SimpleNamespace(global_batch_info={})
    loss_fn(behaviour, current, advantages, mask, "seq-mean-token-mean", info)  # the skipped step's batch
    optimizer.zero_grad()
    rows = slice(0, 3)  # the next step's batch: half the rows, on-policy but for noise
    nearby = behaviour[rows] + 0.01 * torch.randn(3, mask.shape[1])
    loss_fn(nearby, current[rows], advantages[rows], mask[rows], "seq-mean-token-mean", info)
    optimizer.param_groups[0]["params"][0].grad = torch.ones(2)
    optimizer.step()
    expected = float(ess_ratio(sequence_log_weights(current[rows], nearby, mask[rows])))
    assert optimizer.last_ess_ratio == pytest.approx(expected)
    assert optimizer.last_ess_ratio != pytest.approx(float(ess_ratio(torch.cat([
        sequence_log_weights(current, behaviour, mask), sequence_log_weights(current[rows], nearby, mask[rows])]))))


@pytest.mark.parametrize("objective", ["bapo", "m2po"])
def test_batch_scoped_losses_run_on_the_whole_batch_only(batch, objective):
    """bapo's and m2po's statistic is over the batch: on verl's whole global batch (one rank) the loss is vcpo's;
    a micro-batch of it, or one rank of two, is refused with one error (their gradient depends on the split)."""
    from vcpo.integrations.verl import policy_loss
    from vcpo.objectives import ObjectiveInputs, get_objective

    behaviour, current, advantages, mask = batch
    loss_fn = policy_loss(objective)
    whole = SimpleNamespace(global_batch_info={"dp_size": 1, "global_batch_size": 6, "batch_num_tokens": mask.sum()})
    loss, _ = loss_fn(behaviour, current, advantages, mask, "token-mean", whole)
    expected = get_objective(objective)(ObjectiveInputs(logprobs=current, behavior_logprobs=behaviour,
                                                        advantages=advantages, mask=mask), loss_agg="token-mean")
    torch.testing.assert_close(loss, expected.loss)
    with pytest.raises(ValueError, match=f"vcpo_{objective}'s statistic is over the whole batch.*2 of "
                                         "global_batch_size=6 rows on dp_size=1"):
        loss_fn(behaviour[:2], current[:2], advantages[:2], mask[:2], "token-mean", whole)
    two_ranks = SimpleNamespace(global_batch_info={**whole.global_batch_info, "dp_size": 2})
    with pytest.raises(ValueError, match="dp_size=2"):
        loss_fn(behaviour, current, advantages, mask, "token-mean", two_ranks)


def test_a_group_scoped_loss_is_refused(batch):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    import vcpo.integrations.verl  # noqa: F401  (registers the losses)

    behaviour, current, advantages, mask = batch
    with pytest.raises(ValueError, match="vcpo_tb is group-scoped: verl passes a policy loss no prompt ids"):
        get_policy_loss_fn("vcpo_tb")(behaviour, current, advantages, mask, "token-mean",
                                      SimpleNamespace(global_batch_info={}))


def test_opob_on_a_real_dataproto_is_vcpos_with_the_logit_proxy():
    from verl import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    from vcpo.integrations.verl import compute_opob_advantage
    from vcpo.variance import logit_proxy_grad_sq_norms, opob_advantages

    torch.manual_seed(1)
    B, T = 8, 4
    mask = torch.ones(B, T)
    mask[3, 2:] = 0
    old = torch.rand(B, T).log()
    collision = old.exp() ** 2 + torch.rand(B, T) * 0.1
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), (mask.sum(1) - 1).long()] = torch.tensor([1.0, 0, 1, 1, 0, 0, 1, 0])
    uid = np.array(["a"] * 4 + ["b"] * 4, dtype=object)

    def data() -> DataProto:
        return DataProto.from_dict(tensors={"token_level_rewards": rewards.clone(), "response_mask": mask.clone(),
                                            "old_log_probs": old.clone(), "sum_pi_squared": collision.clone()},
                                   non_tensors={"uid": uid})

    ours = compute_opob_advantage(data()).batch["advantages"]
    G = logit_proxy_grad_sq_norms(torch.nn.functional.pad(old, (1, 0)), torch.nn.functional.pad(collision, (1, 0)),
                                  torch.nn.functional.pad(mask, (1, 0)))
    torch.testing.assert_close(G, ((1 - 2 * old.exp() + collision) * mask).sum(1).double())
    expected = opob_advantages(rewards.sum(1), torch.zeros(B), G, torch.arange(B) // 4, variant="grad_only")
    torch.testing.assert_close(ours, (expected[:, None] * mask).float())
    # verl's GRPO estimator on the same batch (what compute_advantage calls for "grpo"; ray_trainer itself does not
    # import here: verl 0.9.1 leaves its cachetools dependency undeclared).
    grpo, _ = compute_grpo_outcome_advantage(rewards, mask, uid)
    assert not torch.allclose(ours, grpo, atol=1e-3)


@pytest.mark.parametrize("with_sum_pi_squared", [False, True])
def test_opob_after_verls_bypass_mode_refuses_without_the_policys_log_probs(with_sum_pi_squared):
    """verl's apply_bypass_mode sets old_log_probs to the rollout's and skips the pass that gives sum_pi_squared:
    OPOB must not run there on the rollout's log-probs (W = 1, G the rollout's) nor fail with a KeyError."""
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode

    from vcpo.integrations.verl import compute_opob_advantage

    torch.manual_seed(2)
    B, T = 4, 3
    tensors = {"token_level_rewards": torch.tensor([[0, 0, 1.0], [0, 0, 0], [0, 0, 1], [0, 0, 0]]),
               "response_mask": torch.ones(B, T), "rollout_log_probs": torch.rand(B, T).log()}
    if with_sum_pi_squared:
        tensors["sum_pi_squared"] = torch.rand(B, T)
    data = DataProto.from_dict(tensors=tensors, non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)})
    apply_bypass_mode(data, rollout_corr_config=OmegaConf.create({"bypass_mode": True}),
                      policy_loss_config=OmegaConf.create({"loss_mode": "vcpo_vcpo"}))
    with pytest.raises(ValueError, match=r"rollout's \(verl's bypass mode\).*add_policy_log_probs"):
        compute_opob_advantage(data, variant="plugin")


@pytest.mark.parametrize("how", ["entry point", "external_lib"])
def test_verl_loads_the_losses_by_its_plugin_entry_point_and_by_external_lib(how):
    program = LOADED if how == "entry point" else (
        "from verl.utils.import_utils import import_external_libs; import_external_libs('vcpo.integrations.verl'); "
        + LOADED)
    policy = "auto" if how == "entry point" else "none"
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": policy, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
    if how == "external_lib":  # and without it, nothing registers them
        bare = subprocess.run([sys.executable, "-c", LOADED], capture_output=True, text=True, env=env, timeout=300)
        assert bare.returncode != 0 and "vcpo_vcpo" in bare.stderr
