"""trainer.sharding=fsdp: 2 and 4 FSDP2-sharded ranks (local processes, gloo) take the same step as one unsharded
learner on the same batch (gradient before clipping, metrics, weights after), for GRPO, VCPO with fast OPOB norms and
the logit proxy, LoRA, untied embeddings,
activation checkpointing, and micro-batches whose count differs between ranks (idle passes);
a sharded checkpoint written by 2 ranks is read whole by one process, and by 4 ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from test_micro_batches import MODEL, make_batch
from vcpo.config import load_config
from vcpo.models.lora import apply_lora_config
from vcpo.train.data_parallel import init_process_group
from vcpo.train.learner import Learner
from vcpo.train.sharding import ShardedLearner, load_sharded, load_sharded_whole, save_sharded, shard_model

from conftest import run_ranks

pytest.importorskip("peft")

CASES = {
    "grpo": ["objective.name=grpo", "advantage.estimator=grpo"],
    "vcpo_opob_fast": ["objective.name=vcpo", "advantage.estimator=opob", "advantage.grad_norm_method=fast"],
    "vcpo_logit_proxy": ["objective.name=vcpo", "advantage.estimator=opob", "advantage.grad_norm_method=logit_proxy"],
    # micro-batches: the ranks' counts differ, so ranks with fewer run idle passes (with the fast capture too)
    "vcpo_fast_micro": ["objective.name=vcpo", "advantage.estimator=opob", "trainer.micro_batch_tokens=24"],
    "grpo_micro_checkpointed": ["objective.name=grpo", "advantage.estimator=grpo", "trainer.micro_batch_tokens=24",
                                "trainer.gradient_checkpointing=true"],
    "bapo_micro": ["objective.name=bapo", "advantage.estimator=grpo", "trainer.micro_batch_tokens=24"],
    "lora_vcpo_fast": ["objective.name=vcpo", "advantage.estimator=opob", "model.lora.rank=4", "model.lora.alpha=8"],
    "untied_vcpo_fast": ["objective.name=vcpo", "advantage.estimator=opob"],  # embeddings and head: units of their own
}
FOUR_RANK_CASES = ("grpo", "vcpo_opob_fast", "lora_vcpo_fast")
UNTIED = copy.deepcopy(MODEL)
UNTIED.lm_head.weight = torch.nn.Parameter(MODEL.lm_head.weight.detach() + 0.01)
UNTIED.config.tie_word_embeddings = False
# 5 groups of 4: 2 ranks take 3 and 2 groups, 4 ranks 2, 1, 1, 1 (uneven on purpose)
BATCH = make_batch(seed=1, rows=20)


def config(overrides: list[str], world_size: int = 1):
    return load_config(None, [*overrides, "trainer.lr=1e-3", "trainer.grad_clip=0.05", "rollout.prompts_per_step=8",
                              f"trainer.num_learners={max(world_size, 2)}", "trainer.sharding=fsdp"])


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def step(learner_cls, overrides: list[str], world_size: int = 1):
    """The step's metrics, the weights after it, and the (summed) gradient before clipping."""
    cfg = config(overrides, world_size)
    torch.manual_seed(0)
    model = apply_lora_config(copy.deepcopy(UNTIED if overrides is CASES["untied_vcpo_fast"] else MODEL).float(),
                              cfg.model.lora)
    if learner_cls is ShardedLearner:
        model = shard_model(model, torch.float32)
    learner = learner_cls(model, cfg)
    learner.backward(BATCH)
    learner.optimizer.accumulate()
    grads = [whole(p.grad) for p in learner.optimizer.updated]
    metrics = learner.step(BATCH)
    return metrics, {k: whole(v) for k, v in model.state_dict().items()}, grads


def _checkpoint_round(world_size: int, tmp: str) -> dict[str, torch.Tensor]:
    """Train a step, save sharded, train a second step; then reload the first and redo the second: the same weights."""
    cfg = config(CASES["vcpo_opob_fast"], world_size)
    model = shard_model(copy.deepcopy(MODEL).float(), torch.float32)
    learner = ShardedLearner(model, cfg)
    learner.step(BATCH)
    save_sharded(model, learner.optimizer, f"{tmp}/w{world_size}")
    learner.step(BATCH)
    second = {k: whole(v) for k, v in model.state_dict().items()}
    load_sharded(model, learner.optimizer, f"{tmp}/w{world_size}")
    learner.step(BATCH)
    again = {k: whole(v) for k, v in model.state_dict().items()}
    assert all(torch.equal(second[k], again[k]) for k in second)
    return second


def _rank(rank: int, world_size: int, port: int, results: str, tmp: str) -> None:
    torch.set_num_threads(1)
    init_process_group(rank, world_size, "127.0.0.1", port, timeout_s=120)
    try:
        names = CASES if world_size == 2 else FOUR_RANK_CASES
        out = {name: step(ShardedLearner, CASES[name], world_size) for name in names}
        if world_size == 2:
            out["checkpoint"] = _checkpoint_round(world_size, tmp)
        if rank == 0:
            torch.save(out, results)
    finally:
        dist.destroy_process_group()


def sharded_ranks(world_size: int, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp(f"ranks{world_size}")
    results = str(tmp / "rank0.pt")
    run_ranks(_rank, world_size, results, str(tmp))
    return torch.load(results) | {"dir": tmp}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    return sharded_ranks(2, tmp_path_factory)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> dict:
    return sharded_ranks(4, tmp_path_factory)


def check_same_step(name: str, sharded: tuple) -> None:
    ref_metrics, ref_after, ref_grads = step(Learner, CASES[name])
    metrics, after, grads = sharded
    for ref, got in zip(ref_grads, grads, strict=True):  # the reduce-scattered gradient is the global one
        assert float((got - ref).norm()) <= 1e-6 * float(ref.norm()) + 1e-12
    for key, ref in ref_after.items():  # Adam amplifies the gradients' rounding (vcpo.train.data_parallel's test)
        assert float((after[key] - ref).norm()) <= 1e-5 * float(ref.norm()), key
    assert ref_metrics["grad_norm"] > 0.05  # clipping acted, on the global norm
    for key in ("grad_norm", "ess/ratio", "adv/abs_mean", "lr", "loss/value"):
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-6), key
    assert metrics.keys() == ref_metrics.keys()


@pytest.mark.parametrize("name", list(CASES))
def test_two_sharded_ranks_take_the_same_step_as_one_learner(two_ranks, name):
    check_same_step(name, two_ranks[name])


@pytest.mark.parametrize("name", FOUR_RANK_CASES)
def test_four_sharded_ranks_take_the_same_step_as_one_learner(four_ranks, name):
    check_same_step(name, four_ranks[name])


def test_a_two_rank_checkpoint_is_read_whole_by_one_process(two_ranks):
    """The step after loading the 2 ranks' checkpoint in one unsharded learner equals the ranks' own second step."""
    cfg = config(CASES["vcpo_opob_fast"])
    model = copy.deepcopy(MODEL).float()
    learner = Learner(model, cfg)
    load_sharded_whole(model, learner.optimizer, two_ranks["dir"] / "w2")
    learner.step(BATCH)
    for key, value in model.state_dict().items():
        ref = two_ranks["checkpoint"][key]
        assert float((value - ref).norm()) <= 1e-5 * float(ref.norm()), key
