"""On a CUDA device (skipped without one; CI has none): the three modes through the command line, every
objective's learner step against the CPU's, fast = exact norms, micro-batched = full-batch, lean = full
log-probs, engine-learner agreement, and a checkpoint written on the GPU resumed on the CPU.

Tolerances: float32 as on the CPU but for GPU reduction order (1e-4 relative where the CPU tests use 1e-6, as
cuBLAS and cuDNN sum in other orders); bfloat16 2e-2 relative for micro-batched against full-batch gradients
(measured 2e-3 to 3e-3 on the CPU, where bfloat16 against float32 is 6e-3) and 5e-3 for fast against exact norms.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import transformers

from test_e2e_cli import metrics, vcpo
from test_micro_batches import BATCH, MODEL
from test_precision_devices import char_tokenizer
from vcpo.config import load_config
from vcpo.objectives import list_objectives
from vcpo.rollout import HFRolloutEngine
from vcpo.train.checkpoint import load_checkpoint, save_checkpoint
from vcpo.train.learner import Learner
from vcpo.types import SamplingParams
from vcpo.variance import logprobs as L
from vcpo.variance import token_logprobs, trajectory_grad_sq_norms

# VCPO_GPU_TESTS_DEVICE=cpu runs these tests' logic on the CPU (to check them on a machine without a GPU).
DEVICE = os.environ.get("VCPO_GPU_TESTS_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")]
CUDA = torch.device(DEVICE)


def learner(overrides: list[str], device: torch.device = CUDA, dtype: torch.dtype = torch.float32) -> Learner:
    return Learner(copy.deepcopy(MODEL).to(device=device, dtype=dtype), load_config(None, ["trainer.lr=1e-3",
                                                                                           *overrides]))


def flat_grads(learner_: Learner) -> torch.Tensor:
    learner_.optimizer.accumulate()
    return torch.cat([p.grad.flatten().float().cpu() for p in learner_.optimizer.updated])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(("mode", "extra"), [
    ("sync", ["model.dtype=bfloat16", "model.lm_head_fp32=true", "trainer.micro_batch_tokens=64"]),
    ("lagged", ["trainer.gradient_checkpointing=true", "advantage.grad_norm_method=exact"]),
    ("async", ["async.inflight_updates=true"]),
])
def test_modes_through_the_command_line_on_cuda(tmp_path, mode, extra):
    run = tmp_path / mode
    vcpo("train", "-c", "configs/quickstart.yaml", f"sft.cache_dir={tmp_path / 'cache'}", "sft.steps=30",
         "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6", "task.eval_size=16",
         "trainer.eval_every=2", "logging.progress=false", f"run_dir={run}", f"async.mode={mode}",
         "async.max_staleness=1", "trainer.max_steps=3", f"model.device={DEVICE}", *extra)
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(m["grad_norm"])) for m in lines)
    assert "mismatch/logprob_abs_max" in lines[0]
    vcpo("train", "--resume", str(run), "trainer.max_steps=4", "model.device=cpu")  # the GPU's checkpoint, on a CPU
    assert [m["step"] for m in metrics(run)] == [1, 2, 3, 4]


@pytest.mark.parametrize("objective", list_objectives())
def test_every_objective_learner_step_on_cuda_matches_the_cpu(objective):
    overrides = [f"objective.name={objective}", "advantage.estimator=opob"]
    gpu, cpu = learner(overrides), learner(overrides, torch.device("cpu"))
    m_gpu, m_cpu = gpu.backward(BATCH), cpu.backward(BATCH)
    assert rel(flat_grads(gpu), flat_grads(cpu)) < 1e-4
    assert m_gpu["loss/value"] == pytest.approx(m_cpu["loss/value"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 5e-3)])
def test_fast_norms_equal_exact_on_cuda(dtype, tolerance):
    model = copy.deepcopy(MODEL).to(device=CUDA, dtype=dtype)
    b = BATCH.to(CUDA)
    args = (model, b.input_ids_BS, b.response_mask_BS, b.attention_mask_BS)
    fast, exact = trajectory_grad_sq_norms(*args, method="fast"), trajectory_grad_sq_norms(*args, method="exact")
    nonzero = exact > 0
    assert ((fast - exact).abs()[nonzero] / exact[nonzero]).max() < tolerance


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("objective", ["vcpo", "ppo_clip", "bapo", "tb"])
def test_micro_batched_equals_full_batch_on_cuda(objective, dtype, tolerance):
    overrides = [f"objective.name={objective}", "advantage.estimator=opob"]
    full, micro = learner(overrides, dtype=dtype), learner([*overrides, "trainer.micro_batch_tokens=24"], dtype=dtype)
    full.backward(BATCH)
    micro.backward(BATCH)
    assert rel(flat_grads(micro), flat_grads(full)) < tolerance


def test_lean_log_probs_equal_the_full_path_on_cuda(monkeypatch):
    model = copy.deepcopy(MODEL).to(CUDA)
    b = BATCH.to(CUDA)
    full = token_logprobs(model, b.input_ids_BS, b.attention_mask_BS)
    monkeypatch.setattr(L, "LEAN_MIN_LOGITS", 0)
    lean = token_logprobs(model, b.input_ids_BS, b.attention_mask_BS, positions=b.response_mask_BS)
    m = b.response_mask_BS.bool()
    assert (lean - full)[m].abs().max() < 1e-5


@pytest.mark.parametrize(("dtype", "fp32_head", "bound"), [(torch.float32, False, 1e-4), (torch.bfloat16, True, 0.1)])
def test_engine_and_learner_agree_on_cuda(dtype, fp32_head, bound):
    model = copy.deepcopy(MODEL).to(device=CUDA, dtype=dtype)
    engine = HFRolloutEngine(model, eos_id=1, pad_id=0, lm_head_fp32=fp32_head)
    prompts = [[5, 9, 33], [7, 3], [12, 13, 14, 15]] * 4
    # A CPU generator, as the rollout sources pass: it seeds one on the GPU.
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=8), generator=torch.Generator().manual_seed(0))
    rows = [p + g.response_ids for p, g in zip(prompts, gens, strict=True)]
    S = max(map(len, rows))
    ids = torch.tensor([r + [0] * (S - len(r)) for r in rows], device=CUDA)
    attention = torch.tensor([[1] * len(r) + [0] * (S - len(r)) for r in rows], device=CUDA)
    lp = token_logprobs(model, ids, attention, lm_head_fp32=fp32_head)
    gap = max((torch.tensor(g.behavior_logprobs, device=CUDA) - lp[b, len(p) : len(p) + len(g.response_ids)])
              .abs().max().item() for b, (p, g) in enumerate(zip(prompts, gens, strict=True)))
    assert gap < bound


def test_checkpoint_written_on_cuda_resumes_on_the_cpu(tmp_path):
    overrides = ["objective.name=vcpo", "advantage.estimator=opob"]
    gpu = learner(overrides, dtype=torch.bfloat16)
    gpu.step(BATCH)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=char_tokenizer())
    ckpt = save_checkpoint(tmp_path, 1, gpu.model, tokenizer, gpu.optimizer, {"step": 1})
    cpu = learner(overrides, torch.device("cpu"), torch.bfloat16)
    load_checkpoint(ckpt, cpu.model, cpu.optimizer)
    for a, b in zip(gpu.optimizer.masters, cpu.optimizer.masters, strict=True):
        assert torch.equal(a.cpu(), b)
    for a, b in zip(gpu.params, cpu.params, strict=True):
        assert torch.equal(a.cpu(), b)


def test_the_engine_takes_a_generator_of_its_own_device_or_the_cpu():
    model = copy.deepcopy(MODEL).to(CUDA)
    engine = HFRolloutEngine(model, eos_id=1, pad_id=0)
    prompts = [[5, 9, 33], [7, 3]]
    for generator in (torch.Generator(CUDA).manual_seed(0), torch.Generator().manual_seed(0)):
        again = copy.deepcopy(generator)
        first = engine.generate(prompts, SamplingParams(max_new_tokens=6), generator=generator)
        second = engine.generate(prompts, SamplingParams(max_new_tokens=6), generator=again)
        assert [g.response_ids for g in first] == [g.response_ids for g in second]  # seeded: reproducible


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 5e-3)])
def test_the_chunked_head_norms_and_update_on_cuda(monkeypatch, dtype, tolerance):
    """The capture's head in vocabulary chunks (the path large batches take): norms equal to the exact ones, and a
    VCPO step's update equal to the one with exact norms."""
    from vcpo.variance import ghost_head

    monkeypatch.setattr(L, "LEAN_MIN_LOGITS", 0)
    monkeypatch.setattr(ghost_head, "VOCAB_CHUNK", 7)
    model = copy.deepcopy(MODEL).to(device=CUDA, dtype=dtype)
    b = BATCH.to(CUDA)
    exact = trajectory_grad_sq_norms(model, b.input_ids_BS, b.response_mask_BS, b.attention_mask_BS, method="exact")
    fast = trajectory_grad_sq_norms(model, b.input_ids_BS, b.response_mask_BS, b.attention_mask_BS, method="fast")
    keep = exact > 0
    assert ((fast - exact)[keep].abs() / exact[keep]).max() < tolerance
    arm = ["objective.name=vcpo", "advantage.estimator=opob"]
    grads = []
    for method in ("exact", "fast"):
        step = learner([*arm, f"advantage.grad_norm_method={method}"], dtype=dtype)
        step.backward(BATCH)
        grads.append(torch.cat([p.grad.float().flatten() for p in step.optimizer.updated]))
    # bfloat16: the capture assembles the gradient, the exact arm backpropagates the loss: two roundings
    assert (grads[1] - grads[0]).norm() <= 10 * tolerance * grads[0].norm()
