"""verl's own actor update on the CPU (`make test-verl`): verl 0.9.1's FSDP2 engine (``FSDPEngineWithLMHead``, what
its ``TrainingWorker.train_batch`` runs for ``update_actor``) with its ``ppo_loss``, a ``vcpo_*`` loss and
``ESSAdamW`` built by verl's ``build_optimizer``, on a tiny local Llama, one gloo rank; its step against vcpo's own
``Learner`` on the same batch. Also verl's log-prob pass (what bypass mode skips) feeding OPOB.

verl 0.9.1 registers no CPU platform (it falls back to CUDA): ``cpu_platform.CPUPlatform`` answers its device
interface for the CPU, and ``VERL_ENGINE_DEVICE=cuda`` selects the FSDP engine, which then runs on the CPU.
``TrainingWorker`` itself does not import here (verl's checkpoint engine needs uvicorn, which verl does not
declare), so the test calls the engine's ``train_batch`` with ``ppo_loss`` as the worker does."""

from __future__ import annotations

import importlib.util
import math
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_ranks, save_tiny_policy

pytestmark = pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed here: "
                                "`make test-verl` runs this tier in .venv-verl")

B, P, R = 8, 3, 5  # rows (2 prompts x 4), prompt and response tokens
LR, CLIP = 1e-2, 1.0
LOSS_AGG = "seq-mean-token-mean"
# Each parameter's update from verl's step against vcpo's, relative to the update's norm: measured at most 1.4e-5
# (float32; Adam's first step is about lr * g / |g| elementwise, so rounding of gradients near 0 shows there).
TOLERANCE = 1e-4


def rollout(model_dir: Path) -> dict[str, torch.Tensor]:
    """A batch as a rollout would give it: responses sampled from the tiny policy, the rollout's log-probs those of
    the policy plus N(0, 0.5) noise per token (an off-policy sampler), the last two responses shorter."""
    from transformers import AutoModelForCausalLM

    from vcpo.variance import token_logprobs

    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, 20, (2, P), generator=g).repeat_interleave(4, dim=0)
    responses = torch.randint(3, 20, (B, R), generator=g)
    response_mask = torch.ones(B, R)
    response_mask[6, 3:] = 0
    response_mask[7, 2:] = 0
    input_ids = torch.cat([prompts, responses], dim=1)
    attention = torch.cat([torch.ones(B, P), response_mask], dim=1).long()
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        lp = token_logprobs(model, input_ids, attention)[:, P:]
    rollout_lp = torch.where(response_mask.bool(), lp + 0.5 * torch.randn(B, R, generator=g), 0.0)
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1])
    return {"prompts": prompts, "responses": responses, "input_ids": input_ids, "attention_mask": attention,
            "position_ids": (attention.cumsum(1) - 1).clamp(min=0), "response_mask": response_mask,
            "rollout_log_probs": rollout_lp, "rewards": rewards}


def grpo_advantages(rollout_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    from vcpo.variance import compute_advantages

    adv = compute_advantages("grpo", rollout_batch["rewards"], torch.arange(B) // 4).float()
    return adv[:, None] * rollout_batch["response_mask"]


def _verl_rank(rank: int, world_size: int, port: int, model_dir: str, results: str) -> None:
    """verl's engine on one gloo rank: its log-prob pass (with sum_pi_squared) and one actor update with
    ``vcpo_vcpo`` and ``ESSAdamW``; saves what the test compares."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), VERL_ENGINE_DEVICE="cuda", VERL_ENGINE_VENDOR="nvidia")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from verl.plugin.platform.platform_manager import set_platform

    from with_verl.cpu_platform import CPUPlatform

    set_platform(CPUPlatform())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        from omegaconf import OmegaConf
        from verl import DataProto
        from verl.trainer.config import CheckpointConfig
        from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode
        from verl.utils import tensordict_utils as tu
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import (
            FSDPEngineConfig,
            FSDPOptimizerConfig,
            HFModelConfig,
        )
        from verl.workers.engine import EngineRegistry
        from verl.workers.utils.losses import ppo_loss
        from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

        import vcpo.integrations.verl  # registers the vcpo_* losses; ESS_WINDOW below

        model_config = HFModelConfig(path=model_dir, override_config={"attn_implementation": "eager"})
        model_config.model_type = "language_model"
        engine = EngineRegistry.new(
            model_type="language_model", backend="fsdp2", model_config=model_config,
            engine_config=FSDPEngineConfig(strategy="fsdp2", dtype="float32", micro_batch_size_per_gpu=2,
                                           mixed_precision={"param_dtype": "fp32"},
                                           infer_micro_batch_size_per_gpu=2),
            optimizer_config=FSDPOptimizerConfig(lr=LR, optimizer="ESSAdamW", optimizer_impl="vcpo.integrations.verl",
                                                 weight_decay=0.0, clip_grad=CLIP, betas=(0.9, 0.999)),
            checkpoint_config=CheckpointConfig())
        engine.initialize()
        batch = rollout(Path(model_dir))
        tensors = {k: v for k, v in batch.items() if k != "rewards"}

        def engine_input(data: DataProto, **meta) -> object:
            td = left_right_2_no_padding(data.to_tensordict())
            tu.assign_non_tensor(td, use_remove_padding=False, use_dynamic_bsz=False, max_token_len_per_gpu=4096,
                                 micro_batch_size_per_gpu=2, use_fused_kernels=False, temperature=1.0,
                                 global_token_num=batch["attention_mask"].sum(1).tolist(), **meta)
            return td

        # verl's log-prob pass, the one bypass mode skips (as RayPPOTrainer._compute_old_log_prob calls it)
        td = engine_input(DataProto.from_dict(tensors=dict(tensors)), calculate_entropy=True,
                          calculate_sum_pi_squared=True, compute_loss=False)
        with engine.eval_mode():
            inferred = engine.infer_batch(td)
        out = inferred["model_output"]
        actor_output = DataProto.from_dict(tensors={
            "old_log_probs": no_padding_2_padding(out["log_probs"], td).float(),
            "sum_pi_squared": no_padding_2_padding(out["sum_pi_squared"], td).float()})

        # the driver's actor config; RayPPOTrainer.init_workers hands the workers theirs before training starts
        driver = OmegaConf.create({
            "_target_": "verl.workers.config.FSDPActorConfig", "strategy": "fsdp2", "rollout_n": 4,
            "ppo_mini_batch_size": B, "ppo_micro_batch_size_per_gpu": 2, "use_torch_compile": False,
            "loss_agg_mode": LOSS_AGG,
            "policy_loss": {"_target_": "verl.workers.config.PolicyLossConfig", "loss_mode": "vcpo_vcpo"}})
        worker_actor = omega_conf_to_dataclass(driver)
        # then each step: bypass mode (old_log_probs = the rollout's) and GRPO advantages
        update = DataProto.from_dict(tensors={**tensors, "advantages": grpo_advantages(batch)})
        apply_bypass_mode(update, policy_loss_config=driver.policy_loss, rollout_corr_config=OmegaConf.create({
            "_target_": "verl.trainer.config.algorithm.RolloutCorrectionConfig", "bypass_mode": True,
            "rollout_is": None, "loss_type": "ppo_clip"}))

        def step(actor, data: DataProto = update) -> tuple[dict, list[str]]:
            """One actor update as TrainingWorker.train_batch runs it; its metrics and the warnings raised."""
            td = engine_input(data, calculate_entropy=False, global_batch_size=B, compute_loss=True)
            with warnings.catch_warnings(record=True) as caught, engine.train_mode():
                warnings.simplefilter("always")
                stepped = engine.train_batch(td, loss_function=lambda *args, **kwargs: (
                    calls.append(actor.policy_loss.loss_mode), ppo_loss(actor, *args, **kwargs))[1])
            return stepped["metrics"], [str(w.message) for w in caught]

        calls: list[str] = []
        metrics, _ = step(worker_actor)
        weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                   for k, v in engine.module.state_dict().items()}
        first = {"lr_scale": engine.optimizer.last_lr_scale, "ess_ratio": engine.optimizer.last_ess_ratio,
                 "grad_norm": metrics["grad_norm"], "calls": list(calls),
                 "vcpo_metrics": any(key.startswith("actor/vcpo/") for key in metrics)}
        # a step verl skips: a NaN advantage makes the gradient norm NaN, and the engine zeroes the gradients
        nan_advantages = update.batch["advantages"].clone()
        nan_advantages[0] = float("nan")
        metrics, _ = step(worker_actor, DataProto.from_dict(tensors={**update.batch.to_dict(),
                                                                     "advantages": nan_advantages}))
        unchanged = all(torch.equal((v.full_tensor() if hasattr(v, "full_tensor") else v), weights[k])
                        for k, v in engine.module.state_dict().items())
        skipped = {"grad_norm": metrics["grad_norm"], "weights_unchanged": unchanged,
                   "window_after": len(vcpo.integrations.verl.ESS_WINDOW.logw)}
        # what the workers run once the driver's switch reaches them (verl#4912's fix)
        calls.clear()
        metrics, caught = step(omega_conf_to_dataclass(driver))
        switched = {"calls": list(calls), "vcpo_metrics": any(key.startswith("actor/vcpo/") for key in metrics),
                    "warnings": caught, "lr_scale": engine.optimizer.last_lr_scale}
        torch.save({"batch": batch, "actor_output": actor_output.batch.to_dict(), "weights": weights, "first": first,
                    "switched": switched, "skipped": skipped, "driver_loss_mode": driver.policy_loss.loss_mode,
                    "old_is_rollout": torch.equal(update.batch["old_log_probs"], batch["rollout_log_probs"])}, results)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def verl_step(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("verl_step")
    model_dir = save_tiny_policy(tmp / "tiny")
    run_ranks(_verl_rank, 1, str(model_dir), str(tmp / "out.pt"))
    return torch.load(tmp / "out.pt", weights_only=False) | {"model_dir": model_dir}


def test_verls_actor_update_with_a_vcpo_loss_and_ess_adamw_is_vcpos_learner_step(verl_step):
    """verl's engine, in bypass mode, split the batch into 4 micro-batches of 2 rows and rescaled each loss to the
    global batch; vcpo's Learner takes the same step on the whole batch (objective vcpo, GRPO advantages, clip 1,
    AdamW, sqrt ESS rule): the same ESS-scaled learning rate and gradient norm to 1e-5, each parameter's update
    to ``TOLERANCE``."""
    from transformers import AutoModelForCausalLM

    from vcpo.config import load_config
    from vcpo.train.learner import Learner
    from vcpo.types import Batch

    batch, first = verl_step["batch"], verl_step["first"]
    assert first["calls"] == ["vcpo_vcpo"] * 4  # verl split the batch into 4 micro-batches of 2 rows
    model = AutoModelForCausalLM.from_pretrained(verl_step["model_dir"], attn_implementation="eager")
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    config = load_config(None, ["objective.name=vcpo", f"objective.loss_agg={LOSS_AGG}", "advantage.estimator=grpo",
                                f"trainer.lr={LR}", f"trainer.grad_clip={CLIP}", "trainer.weight_decay=0.0"])
    learner = Learner(model, config)
    full_mask = torch.cat([torch.zeros(B, P), batch["response_mask"]], dim=1)
    behaviour = torch.cat([torch.zeros(B, P), batch["rollout_log_probs"]], dim=1)
    metrics = learner.step(Batch(batch["input_ids"], batch["attention_mask"], full_mask, behaviour,
                                 torch.zeros(B, P + R, dtype=torch.long), batch["rewards"], torch.arange(B) // 4))
    assert first["ess_ratio"] < 0.9  # an off-policy batch: the ESS rule acted
    assert first["lr_scale"] == pytest.approx(metrics["lr_scale"], rel=1e-5)
    assert first["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
    after = verl_step["weights"]
    gaps = {name: float((after[name] - ours).norm() / (ours - before[name]).norm())
            for name, ours in model.state_dict().items()}
    assert max(gaps.values()) <= TOLERANCE, gaps


def test_which_loss_runs_after_verls_apply_bypass_mode(verl_step):
    """verl 0.9.1's apply_bypass_mode switches the driver's policy_loss.loss_mode to its own "bypass_mode" loss; the
    workers' config was built before, so vcpo_vcpo still runs (verl#4912). Once that switch reaches the workers,
    verl's bypass_mode loss runs instead: vcpo's loss then records nothing and ESSAdamW says so, in a warning, and
    steps unscaled. If verl stops switching the driver's loss, the first assertion fails and this doc must change."""
    assert verl_step["driver_loss_mode"] == "bypass_mode" and verl_step["old_is_rollout"]
    assert verl_step["first"]["calls"] == ["vcpo_vcpo"] * 4 and verl_step["first"]["vcpo_metrics"]
    switched = verl_step["switched"]
    assert switched["calls"] == ["bypass_mode"] * 4 and not switched["vcpo_metrics"]
    assert switched["lr_scale"] == 1.0
    assert any("ESSAdamW: no vcpo_* policy loss recorded a log-weight" in w for w in switched["warnings"])


def test_opob_in_bypass_mode_takes_the_policy_from_verls_log_prob_pass(verl_step):
    """Bypass mode skips verl's log-prob pass; a trainer runs it (sum_pi_squared on) and adds its output with
    add_policy_log_probs: OPOB's G is then the logit proxy of the policy and W the policy over the rollout, as vcpo's
    own functions give them on the same model (verl's pass in float32: 1e-5)."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM
    from verl import DataProto
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode

    from vcpo.integrations.verl import add_policy_log_probs, compute_opob_advantage
    from vcpo.variance import logit_proxy_grad_sq_norms, opob_advantages, sequence_log_weights, token_logprobs

    batch = verl_step["batch"]
    mask = batch["response_mask"]
    rewards = torch.zeros(B, R)
    rewards[torch.arange(B), (mask.sum(1) - 1).long()] = batch["rewards"]
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask,
                                        "rollout_log_probs": batch["rollout_log_probs"]},
                               non_tensors={"uid": np.array(["p0"] * 4 + ["p1"] * 4, dtype=object)})
    apply_bypass_mode(data, rollout_corr_config=OmegaConf.create({"bypass_mode": True}),
                      policy_loss_config=OmegaConf.create({"loss_mode": "vcpo_vcpo"}))
    data = add_policy_log_probs(data, DataProto.from_dict(tensors=verl_step["actor_output"]))
    ours = compute_opob_advantage(data, variant="plugin").batch["advantages"]
    assert torch.equal(data.batch["old_log_probs"], batch["rollout_log_probs"])  # the losses' behaviour policy kept

    model = AutoModelForCausalLM.from_pretrained(verl_step["model_dir"], attn_implementation="eager").eval()
    with torch.no_grad():
        lp, _, collision = token_logprobs(model, batch["input_ids"], batch["attention_mask"], return_collision=True)
    full_mask = torch.cat([torch.zeros(B, P), mask], dim=1)
    G = logit_proxy_grad_sq_norms(lp.double(), collision.double(), full_mask.double())
    logw = sequence_log_weights(lp[:, P:].double(), batch["rollout_log_probs"].double(), mask.double())
    assert logw.abs().min() > 0.1  # W is not 1
    expected = opob_advantages(batch["rewards"].double(), logw, G, torch.arange(B) // 4, variant="plugin")
    torch.testing.assert_close(ours, (expected[:, None] * mask).float(), rtol=1e-5, atol=1e-5)


def test_a_step_verl_skips_leaves_its_log_weights_behind(verl_step):
    """A NaN advantage: verl's optimizer_step sees a non-finite gradient norm, zeroes the gradients and does not step.
    The losses had recorded that step's log-weights; ESSAdamW.zero_grad drops them, so the next step's ESS is its
    own."""
    skipped = verl_step["skipped"]
    assert not math.isfinite(skipped["grad_norm"]) and skipped["weights_unchanged"]
    assert skipped["window_after"] == 0
