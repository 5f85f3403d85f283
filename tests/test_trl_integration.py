"""vcpo inside TRL's real GRPOTrainer (vcpo.integrations.trl), on the CPU with a tiny local model: each generated
batch is reused for two optimizer steps (steps_per_generation=2), so the second step of each is off-policy."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig

from vcpo.integrations.trl import ESSLearningRateCallback, VCPOGRPOTrainer, behaviour_logprobs
from vcpo.variance import (
    ess_lr_scale,
    logit_proxy_grad_sq_norms,
    opob_advantages,
    opob_rows_needing_grad_norms,
    token_logprobs,
    trajectory_grad_sq_norms,
)

from conftest import save_tiny_policy


def digit_share(completions: list[str], **_: object) -> list[float]:
    """A reward that differs between a random model's completions: the share of digits."""
    return [sum(ch.isdigit() for ch in c) / (1 + len(c)) for c in completions]


class AppliedLearningRate(TrainerCallback):
    """Records, inside each ``optimizer.step()``, the learning rate the step uses and the scheduler's value."""

    def __init__(self) -> None:
        self.applied: list[tuple[float, float]] = []

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs) -> None:
        torch_optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds torch's
        torch_optimizer.register_step_pre_hook(
            lambda opt, *_: self.applied.append((opt.param_groups[0]["lr"], lr_scheduler.get_last_lr()[0])))


class Recording(VCPOGRPOTrainer):
    """Keeps the advantages each micro-batch's loss was computed with and, for each generated batch, G_i of its
    completions as vcpo's own functions give them on the model at that moment (built from TRL's batch here)."""

    def opob(self, batch, rewards_N, unscorable_N, group_ids_N):
        model = self.accelerator.unwrap_model(self.model).eval()
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        response = torch.cat([torch.zeros_like(batch["prompt_mask"]), batch["completion_mask"]], dim=1)
        if self.grad_norm_method == "exact":
            self.expected_G = trajectory_grad_sq_norms(model, ids, response, attention, method="exact")
        else:
            with torch.no_grad():
                lp, _, collision = token_logprobs(model, ids, attention, self.temperature, return_collision=True)
            self.expected_G = logit_proxy_grad_sq_norms(lp, collision, response, self.temperature)
            self.policy_lp = lp[:, batch["prompt_ids"].shape[1]:]
        model.train()
        return super().opob(batch, rewards_N, unscorable_N, group_ids_N)

    def _compute_loss(self, model, inputs):
        self.seen_advantages.append(inputs["advantages"].detach().clone())
        return super()._compute_loss(model, inputs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_policy(tmp_path_factory.mktemp("trl") / "tiny")


def make_trainer(model_dir, out_dir, max_steps: int, config: dict | None = None, **vcpo_args) -> Recording:
    """The tiny trainer; ``config`` overrides GRPOConfig's arguments, ``vcpo_args`` go to VCPOGRPOTrainer."""
    torch.manual_seed(0)
    settings = {"per_device_train_batch_size": 4, "num_generations": 4, "steps_per_generation": 2,
                "gradient_accumulation_steps": 1, "max_completion_length": 6, "learning_rate": 5e-2, "seed": 0,
                "temperature": 1.0} | (config or {})
    args = GRPOConfig(output_dir=str(out_dir), use_cpu=True, report_to="none", max_steps=max_steps, logging_steps=1,
                      save_strategy="no", disable_tqdm=True, **settings)
    recorder = AppliedLearningRate()
    trainer = Recording(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=digit_share, args=args,
                        processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[recorder],
                        train_dataset=Dataset.from_dict({"prompt": [f"{i}+{i + 1}=" for i in range(8)]}),
                        **vcpo_args)
    trainer.seen_advantages, trainer.applied_lr = [], recorder.applied
    return trainer


def train(model_dir, out_dir, max_steps: int, config: dict | None = None, **vcpo_args) -> Recording:
    trainer = make_trainer(model_dir, out_dir, max_steps, config, **vcpo_args)
    trainer.train()
    return trainer


def step_logs(trainer) -> list[dict]:
    return [line for line in trainer.state.log_history if "loss" in line]


def test_the_reused_batch_is_off_policy_and_the_applied_lr_is_the_schedule_times_the_ess_rule(model_dir, tmp_path):
    trainer = train(model_dir, tmp_path, max_steps=4)
    logs = step_logs(trainer)
    applied = trainer.applied_lr
    assert [line["step"] for line in logs] == [1, 2, 3, 4] and len(applied) == 4
    for line, (lr, scheduled) in zip(logs, applied, strict=True):
        assert math.isclose(lr, scheduled * ess_lr_scale(line["ess/ratio"], 1.0, "sqrt"), rel_tol=1e-12)
        assert line["lr_scale"] == ess_lr_scale(line["ess/ratio"], 1.0, "sqrt")
        assert scheduled == pytest.approx(5e-2 * (1 - (line["step"] - 1) / 4))  # TRL's linear schedule, unscaled
    fresh, stale = logs[0::2], logs[1::2]  # the first and second steps on each generated batch
    assert all(line["is/logw_abs_max"] < 1e-5 and line["ess/ratio"] == pytest.approx(1.0) for line in fresh)
    assert all(line["is/logw_abs_max"] > 1e-3 and line["ess/ratio"] < 1.0 for line in stale), stale
    assert applied[1][0] < applied[1][1]  # the stale step's lr really was cut


@pytest.mark.parametrize("method", ["logit_proxy", "exact"])
def test_opob_advantages_are_vcpos_on_the_same_rewards_and_norms(model_dir, tmp_path, method):
    trainer = train(model_dir, tmp_path, max_steps=2, grad_norm_method=method)  # one generated batch
    batch = trainer.last_opob
    needed_N = opob_rows_needing_grad_norms(batch.rewards_N, batch.group_ids_N)
    assert bool(needed_N.any()), "no group with differing rewards: nothing to compare"
    torch.testing.assert_close(batch.grad_sq_norms_N[needed_N], trainer.expected_G[needed_N].double(), rtol=1e-9,
                               atol=0)
    assert not batch.grad_sq_norms_N[~needed_N].any()
    assert not batch.logw_N.any()  # TRL sampled with the trainer's own model: W = 1 at generation
    expected = opob_advantages(batch.rewards_N, torch.zeros(8, dtype=torch.float64), batch.grad_sq_norms_N,
                               batch.group_ids_N, variant="grad_only")
    torch.testing.assert_close(batch.advantages_N, expected)
    assert not torch.allclose(batch.advantages_N.float(), batch.trl_advantages_N, atol=1e-3)  # GRPO's differ
    seen = torch.cat(trainer.seen_advantages)
    torch.testing.assert_close(seen.sort().values, batch.advantages_N.float().sort().values)
    assert list(trainer._logs["advantages"]) == batch.advantages_N.tolist()  # TRL's completions table too


@pytest.mark.parametrize("objective", ["ppo_clip", "vespo", "tb", "topr"])
def test_other_objectives_train_with_trl_advantages(model_dir, tmp_path, objective):
    trainer = train(model_dir, tmp_path, max_steps=2, objective=objective, advantage_estimator="trl")
    logs = step_logs(trainer)
    assert len(logs) == 2 and all(math.isfinite(line["loss"]) for line in logs)
    assert trainer.last_opob is None


def test_behaviour_logprobs_prefer_the_generators_then_the_policy_at_generation():
    current = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.5, -3.5]])
    sampled = torch.tensor([[-1.2, float("nan"), -3.2]])
    assert torch.equal(behaviour_logprobs({}, current), current.detach())
    assert torch.equal(behaviour_logprobs({"old_per_token_logps": old}, current), old)
    both = {"old_per_token_logps": old, "sampling_per_token_logps": sampled}
    assert torch.equal(behaviour_logprobs(both, current), torch.tensor([[-1.2, -2.5, -3.2]]))
    only_sampled = {"sampling_per_token_logps": sampled}
    assert torch.equal(behaviour_logprobs(only_sampled, current), torch.tensor([[-1.2, -2.0, -3.2]]))


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"objective": "nope"}, "valid names"),
    ({"objective": "vespo", "objective_kwargs": {"k_pos": -1.0}}, "k_pos"),
    ({"advantage_estimator": "gae"}, "advantage_estimator"),
    ({"opob_variant": "x"}, "opob_variant"),
    ({"grad_norm_method": "x"}, "grad_norm_method"),
])
def test_bad_arguments_are_one_error_naming_them(kwargs, named):
    with pytest.raises(ValueError, match=named):
        VCPOGRPOTrainer(**kwargs)


def test_ess_callback_rejects_a_bad_rule_and_leaves_a_step_without_log_weights_alone():
    with pytest.raises(ValueError, match="rule"):
        ESSLearningRateCallback({}, rule="cubic")
    callback = ESSLearningRateCallback({})
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    callback.on_pre_optimizer_step(None, None, None, optimizer=optimizer)
    assert optimizer.param_groups[0]["lr"] == 0.1


DIGITS = list("0123456789")


def digit_generator(prompts: list, trainer) -> dict:
    """A ``rollout_func`` that is not the trainer's policy: 6 digits drawn uniformly per completion, with its own
    log-probs (log 1/10 per token), as a vLLM server or an agent framework would return them."""
    tokenizer = trainer.processing_class
    digit_ids = tokenizer.convert_tokens_to_ids(DIGITS)
    g = torch.Generator().manual_seed(trainer.state.global_step)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    completions = [[digit_ids[int(i)] for i in torch.randint(0, 10, (6,), generator=g)] for _ in prompts]
    return {"prompt_ids": prompt_ids, "completion_ids": completions,
            "logprobs": [[-math.log(10.0)] * 6 for _ in prompts]}


def test_opob_takes_w_from_a_generators_own_log_probs_when_trl_kept_no_old_ones(model_dir, tmp_path):
    """A rollout_func returns its own log-probs, and each batch is used for one step (steps_per_generation =
    gradient_accumulation_steps): TRL keeps sampling_per_token_logps but no old_per_token_logps. W is the trainer's
    policy over the generator's, far from 1; OPOB's plugin variant must see it, as the objective does."""
    trainer = train(model_dir, tmp_path, max_steps=1, config={"steps_per_generation": 1}, rollout_func=digit_generator,
                    opob_variant="plugin")
    batch = trainer.last_opob
    completion_mask = batch.response_mask_BS[:, -6:]
    expected = ((trainer.policy_lp.double() + math.log(10.0)) * completion_mask).sum(1)
    assert expected.abs().min() > 1.0  # the generator is far from the policy
    torch.testing.assert_close(batch.logw_N, expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(batch.advantages_N, opob_advantages(batch.rewards_N, batch.logw_N, batch.grad_sq_norms_N,
                                                                   batch.group_ids_N, variant="plugin"))


def test_trls_loss_options_that_do_nothing_get_one_warning(model_dir, tmp_path):
    with pytest.warns(UserWarning, match=r"ignores loss_type='grpo', epsilon=0.3, delta=1.5: the vcpo objective "
                                         r"'vcpo' replaces TRL's loss") as caught:
        make_trainer(model_dir, tmp_path, max_steps=1, config={"loss_type": "grpo", "epsilon": 0.3, "delta": 1.5})
    assert sum("ignores" in str(w.message) for w in caught) == 1


def test_ess_learning_rate_with_deepspeed_is_refused(model_dir, tmp_path, monkeypatch):
    """accelerate takes DeepSpeed's optimizer step inside backward(): the callback's scale would act on a no-op
    optimizer.step(). DeepSpeed is not installed here, so the test sets the flag Trainer derives from accelerate's
    DeepSpeed plugin, where Trainer sets it."""
    from transformers import Trainer

    create = Trainer.create_accelerator_and_postprocess

    def as_deepspeed(self):
        create(self)
        self.is_deepspeed_enabled = True

    monkeypatch.setattr(Trainer, "create_accelerator_and_postprocess", as_deepspeed)
    with pytest.raises(ValueError, match="ess_lr_rule with DeepSpeed"):
        make_trainer(model_dir, tmp_path, max_steps=1)
