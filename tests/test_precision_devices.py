"""Devices and precision: the config's device, the whole learner in bfloat16 on the CPU (float32 master weights,
micro-batches, fast = exact norms), checkpoints of the master weights through the loading path a GPU checkpoint
takes to a CPU, activation checkpointing and the training-inference mismatch metrics."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers

from test_e2e_cli import vcpo
from test_micro_batches import BATCH, MODEL
from vcpo.config import ConfigError, load_config
from vcpo.objectives import ObjectiveInputs, get_objective, list_objectives
from vcpo.rollout import HFRolloutEngine
from vcpo.runtime import resolve_device
from vcpo.train.checkpoint import load_checkpoint, save_checkpoint
from vcpo.train.learner import Learner
from vcpo.train.precision import LearnerOptimizer
from vcpo.types import SamplingParams

from conftest import metrics

BF16 = torch.bfloat16


def learner(overrides: list[str], dtype: torch.dtype = torch.float32, model=MODEL) -> Learner:
    return Learner(copy.deepcopy(model).to(dtype), load_config(None, ["trainer.lr=1e-3", *overrides]))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_device_key_is_validated_and_resolved():
    with pytest.raises(ConfigError, match="model.device"):
        load_config(None, ["model.device=gpu"])
    assert load_config(None, ["model.device=cuda:1"]).model.device == "cuda:1"
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ConfigError, match="model.device='cuda'.*not available"):
            resolve_device("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a CPU-only machine")
def test_cli_cuda_on_a_cpu_machine_is_one_line_exit_2(tmp_path):
    proc = vcpo("train", "-c", "configs/quickstart.yaml", "model.device=cuda", f"run_dir={tmp_path / 'r'}",
                check=False)
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "model.device" in lines[0], proc.stderr


@pytest.mark.parametrize("objective", ["vcpo", "ppo_clip", "bapo"])
def test_bfloat16_learner_keeps_float32_masters_and_matches_float32(objective):
    overrides = [f"objective.name={objective}", "advantage.estimator=opob"]
    full32, full16 = learner(overrides), learner(overrides, BF16)
    micro16 = learner([*overrides, "trainer.micro_batch_tokens=24"], BF16)
    m32, m16, mm16 = full32.step(BATCH), full16.step(BATCH), micro16.step(BATCH)
    assert m16["opob/grad_sq_norm_mean"] == pytest.approx(m32["opob/grad_sq_norm_mean"], rel=0.05)
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=0.05)
    # Micro-batches sum their gradients in float32: bfloat16 rounding of the forward is all that differs.
    assert mm16["grad_norm"] == pytest.approx(m16["grad_norm"], rel=0.02)
    opt = full16.optimizer
    assert opt.has_masters and all(m.dtype == torch.float32 for m in opt.masters)
    for p, m, p32 in zip(full16.params, opt.masters, full32.params, strict=True):
        assert p.dtype == BF16 and torch.equal(p, m.to(BF16))  # the model holds its masters, rounded
        assert rel(m, p32) < 1e-2


def test_masters_keep_updates_below_bfloat16_resolution():
    lr = 1e-6  # Adam's first step moves each weight by about lr: far below bfloat16's 2^-8 relative spacing
    step16 = learner(["objective.name=reinforce", "advantage.estimator=grpo", f"trainer.lr={lr}"], BF16)
    before = [m.clone() for m in step16.optimizer.masters]
    step16.step(BATCH)
    moved = [(m - b).abs().max().item() for m, b in zip(step16.optimizer.masters, before, strict=True)]
    assert max(moved) == pytest.approx(lr, rel=0.1)


def test_master_weights_survive_a_checkpoint_through_the_cpu_loading_path(tmp_path):
    """save_checkpoint / load_checkpoint load optimizer state with map_location='cpu' and copy it to the
    parameters' device: the path a GPU checkpoint takes to a CPU run. A resumed learner continues exactly."""
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=char_tokenizer())
    overrides = ["objective.name=vcpo", "advantage.estimator=opob"]
    first = learner(overrides, BF16)
    first.step(BATCH)
    ckpt = save_checkpoint(tmp_path, 1, first.model, tokenizer, first.optimizer, {"step": 1})
    resumed = learner(overrides, BF16, model=_other_model())
    load_checkpoint(ckpt, resumed.model, resumed.optimizer)
    for a, b in zip(first.optimizer.masters, resumed.optimizer.masters, strict=True):
        assert torch.equal(a, b)
    first.step(BATCH)
    resumed.step(BATCH)
    for a, b in zip(first.params, resumed.params, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="master weights"):
        LearnerOptimizer(learner(overrides).params, 1e-3, (0.9, 0.999), 0.0).load_state_dict(
            first.optimizer.state_dict())


def test_float32_optimizer_state_is_plain_adamw():
    opt = learner(["objective.name=grpo", "advantage.estimator=grpo"]).optimizer
    assert not opt.has_masters and set(opt.state_dict()) == {"state", "param_groups"}


@pytest.mark.parametrize(("objective", "method"), [("grpo", "fast"), ("vcpo", "fast"), ("ppo_clip", "fast"),
                                                   ("vcpo", "exact")])
def test_activation_checkpointing_gives_the_same_gradients(objective, method):
    overrides = [f"objective.name={objective}", "advantage.estimator=opob", f"advantage.grad_norm_method={method}"]
    plain = learner(overrides)
    checkpointed = learner([*overrides, "trainer.gradient_checkpointing=true", "trainer.micro_batch_tokens=24"])
    assert checkpointed.checkpointed  # the decoder layers
    plain.backward(BATCH)
    checkpointed.backward(BATCH)
    for a, b in zip(plain.params, checkpointed.params, strict=True):
        assert (a.grad - b.grad).norm() <= 1e-6 * a.grad.norm()
    assert not any(m.training for m in checkpointed.model.modules())  # eval mode restored after each pass


def test_mismatch_metrics_cover_tokens_of_the_current_version_only():
    batch = copy.deepcopy(BATCH)
    fresh = learner(["objective.name=vcpo", "advantage.estimator=grpo"])
    m = fresh.backward(batch)  # every token has version 0 = the learner's
    gap = (batch.behavior_logprobs_BS - fresh.logprobs(batch, grad=False)).abs()[batch.response_mask_BS.bool()]
    assert m["mismatch/logprob_abs_max"] == pytest.approx(float(gap.max()), rel=1e-6)
    assert m["mismatch/logprob_abs_mean"] == pytest.approx(float(gap.mean()), rel=1e-6)
    batch.versions_BS[:6] = 1  # rows 0-5 from another version: left out
    gap = (batch.behavior_logprobs_BS - fresh.logprobs(batch, grad=False)).abs()[6:][batch.response_mask_BS[6:] > 0]
    assert fresh.backward(batch)["mismatch/logprob_abs_max"] == pytest.approx(float(gap.max()), rel=1e-6)
    fresh.version = 5
    assert "mismatch/logprob_abs_max" not in fresh.backward(batch)


def char_tokenizer():
    from vcpo.models.default import build_char_tokenizer

    return build_char_tokenizer("abc").backend_tokenizer


def _other_model() -> torch.nn.Module:
    torch.manual_seed(7)
    return transformers.LlamaForCausalLM(MODEL.config).eval()


def test_gpu_config_runs_on_the_cpu_with_a_local_model(tmp_path):
    """configs/gpu_qwen2.5-0.5b.yaml's code path (a local model in bfloat16, float32 LM head, micro-batches, fast
    OPOB) through the command line, on the CPU with a tiny local Llama in place of the downloaded model."""
    from vcpo.config import TaskConfig
    from vcpo.models.default import build_default_model
    from vcpo.tasks import make_task

    cfg = load_config("configs/gpu_qwen2.5-0.5b.yaml")
    assert (cfg.model.dtype, cfg.model.device, cfg.model.lm_head_fp32) == ("bfloat16", "cuda", True)
    task = TaskConfig(name=cfg.task.name, kwargs=cfg.task.kwargs)
    model_dir = build_default_model(make_task(task), 0, tmp_path / "model")
    run = tmp_path / "run"
    vcpo("train", "-c", "configs/gpu_qwen2.5-0.5b.yaml", f"model.path={model_dir}", "model.device=cpu",
         f"run_dir={run}", "async.mode=sync", "trainer.max_steps=2", "rollout.prompts_per_step=2",
         "rollout.group_size=4", "task.eval_size=8", "trainer.micro_batch_tokens=64", "logging.progress=false",
         "runtime.torch_threads=1")
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2] and "mismatch/logprob_abs_max" in lines[0]


@pytest.mark.parametrize(("key", "named"), [("model.lm_head_fp32=true", "model.lm_head_fp32: ScaledLogits"),
                                            ("trainer.gradient_checkpointing=true", "trainer.gradient_checkpointing")])
def test_options_a_model_cannot_honour_are_one_config_error(key, named):
    from test_logprobs import ScaledLogits

    with pytest.raises(ConfigError, match=named):
        Learner(ScaledLogits(), load_config(None, [key]))


@pytest.mark.parametrize("overrides", [
    ["objective.name=grpo", "advantage.estimator=grpo"],
    ["objective.name=vcpo"],
    ["objective.name=ppo_clip", "trainer.micro_batch_tokens=24", "trainer.gradient_checkpointing=true"],
    ["objective.name=bapo", "advantage.grad_norm_method=exact", "trainer.micro_batch_tokens=24"],
    ["objective.name=tb", "trainer.micro_batch_tokens=24", "model.lm_head_fp32=true"],
], ids=["grpo", "vcpo_fast", "micro_ckpt", "two_pass_exact", "tb_fp32_head"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_every_tensor_follows_its_inputs_device(overrides, dtype):
    """CUDA's crash of the issue (a quantile's q tensor built on the CPU) on a CPU machine: with the default device
    set to "meta", any tensor created without a device lands there and mixing it with the CPU inputs fails. A
    learner step (and the engine, and every objective within) must create nothing there."""
    step_learner = learner(overrides, dtype)
    step_learner.logprobs(BATCH, grad=False)  # split_head's one-time check runs a forward: outside the context
    fp32_head = step_learner.config.model.lm_head_fp32
    engine = HFRolloutEngine(step_learner.model, eos_id=1, pad_id=0, lm_head_fp32=fp32_head)
    engine.generate([[3]], SamplingParams(max_new_tokens=1))  # its float32 head copy, made outside
    with torch.device("meta"):
        metrics = step_learner.step(BATCH)
        gens = engine.generate([[3, 4], [5]], SamplingParams(max_new_tokens=4), generator=torch.Generator())
    assert math.isfinite(metrics["grad_norm"]) and len(gens) == 2


@pytest.mark.parametrize("objective", list_objectives())
def test_every_objective_creates_its_tensors_on_its_inputs_device(objective):
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(6, 5, generator=g)).requires_grad_()
    inp = ObjectiveInputs(logprobs=lp, behavior_logprobs=lp.detach() + 0.3 * torch.randn(6, 5, generator=g),
                          advantages=torch.randn(6, generator=g), mask=torch.ones(6, 5),
                          rewards=torch.rand(6, generator=g), group_ids=torch.tensor([0, 0, 0, 1, 1, 1]))
    with torch.device("meta"):  # see test_every_tensor_follows_its_inputs_device
        get_objective(objective)(inp).loss.backward()
    assert lp.grad is not None and lp.grad.device.type == "cpu"
