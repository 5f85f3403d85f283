"""vcpo inside TRL's real asynchronous GRPO trainer (vcpo.integrations.trl_async), on the CPU with a tiny local model:
vcpo's in-process rollout worker generates in a thread beside TRL's training loop, so batches arrive versions stale."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.experimental.async_grpo import AsyncGRPOConfig
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow
from trl.trainer.utils import add_fused_lm_head

from test_trl_integration import AppliedLearningRate
from vcpo.integrations.trl import LocalRolloutWorker, LocalWeightTransfer, VCPOAsyncGRPOTrainer
from vcpo.integrations.trl_async import OPOBRolloutQueue, tokens_by_sequence
from vcpo.integrations.trl_local import use_reference_tree_attention
from vcpo.variance import (
    ess_lr_scale,
    logit_proxy_grad_sq_norms,
    opob_advantages,
    sequence_log_weights,
    token_logprobs,
    trajectory_grad_sq_norms,
)

from conftest import save_tiny_policy


def distinct_share(completions: list[str], **_: object) -> list[float]:
    """A reward that differs between a random model's completions: the share of distinct characters."""
    return [len(set(c)) / (1 + len(c)) for c in completions]


class Recording(VCPOAsyncGRPOTrainer):
    """Keeps every group's OPOB inputs with W and G recomputed by vcpo's own functions on a plain (SDPA) copy of
    the trainer's policy at that moment, and the advantages each micro-batch's loss was computed with."""

    def opob(self, samples):
        plain = AutoModelForCausalLM.from_pretrained(self.model_dir, attn_implementation="sdpa").eval()
        plain.load_state_dict(self.accelerator.unwrap_model(self.model).state_dict())
        previous = self.last_opob
        advantages = super().opob(samples)
        if self.last_opob is previous:  # a group too stale for TRL's dataset, which drops it: no OPOB computed
            return advantages
        expected_logw, expected_G = [], []
        for s in samples:
            ids = torch.as_tensor(s.input_ids)[None]
            mask = torch.as_tensor(s.completion_mask)[None]
            with torch.no_grad():
                lp, _, collision = token_logprobs(plain, ids, temperature=self.temperature, return_collision=True)
            if self.grad_norm_method == "logit_proxy":
                expected_G.append(logit_proxy_grad_sq_norms(lp, collision, mask, self.temperature)[0])
            else:  # the fast norms against the exact reference (temperature 1 here)
                expected_G.append(trajectory_grad_sq_norms(plain, ids, mask, method="exact")[0])
            expected_logw.append(sequence_log_weights(lp.double(), torch.as_tensor(s.old_log_probs)[None].double(),
                                                      mask)[0])
        self.groups.append((self.last_opob, torch.stack(expected_logw), torch.stack(expected_G)))
        return advantages

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        selected = inputs["token_index"] >= 0
        advantages_ST, _ = tokens_by_sequence(inputs["advantages"][selected], inputs["segment_id"][selected])
        self.seen_advantages.append(advantages_ST[:, 0].clone())
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_policy(tmp_path_factory.mktemp("trl_async") / "tiny")


def train(model_dir, out_dir, max_steps: int, max_staleness: int = 3, **vcpo_args) -> tuple[Recording, list]:
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = Dataset.from_dict({"prompt": [f"{i}+{i + 1}=" for i in range(8)]})
    worker = LocalRolloutWorker(str(model_dir), tokenizer, prompts, distinct_share, num_generations=4,
                                max_completion_length=6, queue_maxsize=64, prompts_per_batch=2, seed=0)
    args = AsyncGRPOConfig(output_dir=str(out_dir), use_cpu=True, bf16=False, gradient_checkpointing=False,
                           report_to="none", per_device_train_batch_size=8, num_generations=4,
                           max_completion_length=6, max_steps=max_steps, learning_rate=5e-2,
                           lr_scheduler_type="linear", logging_steps=1, save_strategy="no", seed=0, temperature=1.0,
                           disable_tqdm=True, token_budget=0, max_staleness=max_staleness)
    recorder = AppliedLearningRate()
    try:
        trainer = Recording(model=str(model_dir), reward_funcs=distinct_share, args=args, train_dataset=prompts,
                            processing_class=tokenizer, callbacks=[recorder], rollout_worker=worker, **vcpo_args)
        trainer.model_dir, trainer.groups, trainer.seen_advantages = model_dir, [], []
        trainer.train()
    finally:
        worker.stop()
    assert not worker.is_alive()
    return trainer, recorder.applied


def step_logs(trainer) -> list[dict]:
    return [line for line in trainer.state.log_history if "loss" in line]


def test_stale_batches_cut_the_applied_lr_by_the_ess_rule_and_train_on_vcpos_opob(model_dir, tmp_path):
    trainer, applied = train(model_dir, tmp_path, max_steps=6)
    logs = step_logs(trainer)
    assert [line["step"] for line in logs] == list(range(1, 7)) and len(applied) == 6
    for line, (lr, scheduled) in zip(logs, applied, strict=True):
        rule = ess_lr_scale(line["ess/ratio"], 1.0, "sqrt")
        assert math.isclose(lr, scheduled * rule, rel_tol=1e-12) and line["lr_scale"] == rule
        assert scheduled == pytest.approx(5e-2 * (1 - (line["step"] - 1) / 6))  # TRL's linear schedule, unscaled
    fresh = [line for line in logs if line["sample/staleness_max"] == 0]
    stale = [line for line in logs if line["sample/staleness_max"] > 0]
    assert fresh and stale, [line["sample/staleness_max"] for line in logs]
    # float32 on both sides: the sampler's log-probs are the trainer's own at staleness 0
    assert all(line["is/logw_abs_max"] < 1e-4 and line["ess/ratio"] == pytest.approx(1.0) for line in fresh)
    assert all(line["is/logw_abs_max"] > 1e-2 and line["ess/ratio"] < 1.0 for line in stale)
    assert min(lr / scheduled for lr, scheduled in applied) < 0.99  # a stale step's lr really was cut

    stale_groups = [g for g, _, _ in trainer.groups if g.sample_version < g.trainer_version]
    assert stale_groups and all(g.logw_G.abs().max() > 1e-2 for g in stale_groups)  # W != 1 in OPOB's inputs
    assert_opob_is_vcpos(trainer.groups, rtol=1e-6)
    assert any(not torch.allclose(g.advantages_G, g.worker_advantages_G, atol=1e-3) for g, _, _ in trainer.groups)
    computed = torch.cat([g.advantages_G for g, _, _ in trainer.groups]).float()
    for seen in torch.cat(trainer.seen_advantages):  # every sequence trained on carries its group's OPOB advantage
        assert torch.isclose(computed, seen, rtol=0, atol=1e-6).any()


def assert_opob_is_vcpos(groups: list, rtol: float) -> None:
    """Each group's W and G are vcpo's on the trainer's policy (G measured where rewards differ), and its
    advantages ``opob_advantages(R, logW, G, group, variant="grad_only")``."""
    varied = 0
    for group, expected_logw, expected_G in groups:
        torch.testing.assert_close(group.logw_G, expected_logw, rtol=0, atol=1e-5)
        if group.rewards_G.max() > group.rewards_G.min():
            varied += 1
            torch.testing.assert_close(group.grad_sq_norms_G, expected_G.double(), rtol=rtol, atol=0)
        else:
            assert not group.grad_sq_norms_G.any()  # equal rewards: advantage 0 whatever G is, so none measured
        expected = opob_advantages(group.rewards_G, group.logw_G, group.grad_sq_norms_G,
                                   torch.zeros(4, dtype=torch.long), variant="grad_only")
        torch.testing.assert_close(group.advantages_G, expected)
    assert varied, "no group with differing rewards: nothing to compare"


def test_another_objective_with_the_fast_norms_of_opob(model_dir, tmp_path):
    trainer, _ = train(model_dir, tmp_path, max_steps=3, objective="vespo", grad_norm_method="fast")
    logs = step_logs(trainer)
    assert len(logs) == 3 and all(math.isfinite(line["loss"]) for line in logs)
    assert_opob_is_vcpos(trainer.groups, rtol=1e-4)  # ghost norms against the exact per-row backward


def test_the_workers_advantages_without_the_ess_learning_rate(model_dir, tmp_path):
    trainer, _ = train(model_dir, tmp_path, max_steps=2, advantage_estimator="trl", ess_lr_rule=None)
    logs = step_logs(trainer)
    assert len(logs) == 2 and all(math.isfinite(line["loss"]) for line in logs)
    assert trainer.last_opob is None and not trainer.groups and "lr_scale" not in logs[0]


def test_reference_tree_attention_is_the_plain_forward_of_each_sample(model_dir):
    use_reference_tree_attention()
    packed_model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=TREE_ATTENTION)
    add_fused_lm_head(packed_model, temperature=0.7, outputs=("log_probs",))
    plain = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(0)
    prompts = ([5, 6, 7, 8], [9, 10])
    samples, row = [], TreeRow()
    for i in range(5):  # two prompts, completions sharing first tokens with their group's others
        completion = [11, 12][: i % 3] + torch.randint(3, 30, (2 + i,), generator=g).tolist()
        ids = np.array(prompts[i % 2] + completion)
        samples.append({"input_ids": ids, "completion_mask": (np.arange(len(ids)) >= len(prompts[i % 2])).astype(int),
                        "old_log_probs": np.zeros(len(ids), dtype=np.float32), "advantage": 0.0, "group_id": i % 2})
        row.add(samples[-1])
    p = row.pack()
    assert int(p["input_ids"].numel()) < sum(len(s["input_ids"]) for s in samples)  # prefixes really are shared
    out = packed_model(input_ids=p["input_ids"][None], position_ids=p["position_ids"][None],
                       shift_labels=p["shift_labels"][None], fused_lm_head=True, tree_kv_index=p["tree_kv_index"],
                       tree_cu_seqlens_q=p["tree_cu_seqlens_q"], tree_cu_seqlens_k=p["tree_cu_seqlens_k"],
                       tree_max_seqlen_q=int(p["tree_max_seqlens"][0]),
                       tree_max_seqlen_k=int(p["tree_max_seqlens"][1]))
    packed_lp = out.log_probs.flatten()[p["token_index"]]
    with torch.no_grad():
        expected = torch.cat([token_logprobs(plain, torch.as_tensor(s["input_ids"])[None], temperature=0.7)[0][
            torch.as_tensor(s["completion_mask"]).bool()] for s in samples])
    torch.testing.assert_close(packed_lp.detach(), expected, rtol=0, atol=1e-5)


def test_tokens_by_sequence_lays_the_flat_terms_out_per_sample():
    values, mask = tokens_by_sequence(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), torch.tensor([0, 0, 0, 1, 2, 2]))
    assert torch.equal(values, torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 0.0]]))
    assert torch.equal(mask, torch.tensor([[True, True, True], [True, False, False], [True, True, False]]))
    with pytest.raises(ValueError, match="segment_id"):
        tokens_by_sequence(torch.ones(3), torch.tensor([1, 0, 1]))


def test_the_opob_queue_releases_whole_groups_with_their_new_advantages():
    import queue

    source = queue.Queue()

    def sample(group_id: int, advantage: float) -> RolloutSample:
        return RolloutSample(prompt="p", completion="c", input_ids=np.zeros(2, dtype=np.int64),
                             completion_mask=np.ones(2, dtype=np.int64), old_log_probs=np.zeros(2, dtype=np.float32),
                             advantage=advantage, model_version=0, group_id=group_id, metrics={})

    for group_id, advantage in ((0, 1.0), (1, 2.0), (0, 3.0), (1, 4.0)):  # two groups, interleaved
        source.put(sample(group_id, advantage))
    opob = OPOBRolloutQueue(source, 2, lambda group: torch.tensor([-s.advantage for s in group]))
    out = [opob.get(timeout=0.01) for _ in range(4)]
    assert [(s.group_id, s.advantage) for s in out] == [(0, -1.0), (0, -3.0), (1, -2.0), (1, -4.0)]
    source.put(sample(2, 5.0))
    with pytest.raises(queue.Empty):  # half a group: nothing leaves yet
        opob.get(timeout=0.01)
    assert opob.qsize() == 0


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"objective": "nope"}, "valid names"),
    ({"objective": "m2po"}, "batch-scoped"),
    ({"objective": "tb"}, "group-scoped"),
    ({"advantage_estimator": "gae"}, "advantage_estimator"),
    ({"grad_norm_method": "x"}, "grad_norm_method"),
    ({"tools": [print]}, "tools"),
])
def test_bad_arguments_are_one_error_naming_them(kwargs, named):
    with pytest.raises(ValueError, match=named):
        VCPOAsyncGRPOTrainer("unused", **kwargs)


def test_a_bad_worker_argument_is_one_error_and_a_failed_worker_is_reported(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = Dataset.from_dict({"prompt": ["1+2="]})
    with pytest.raises(ValueError, match="prompt 0 is not a string"):
        LocalRolloutWorker(str(model_dir), tokenizer, Dataset.from_dict({"prompt": [[{"role": "user"}]]}),
                           distinct_share)
    with pytest.raises(ValueError, match="queue_maxsize"):
        LocalRolloutWorker(str(model_dir), tokenizer, prompts, distinct_share, num_generations=4, queue_maxsize=2)

    def broken(**_: object) -> list[float]:
        raise KeyError("answer")

    worker = LocalRolloutWorker(str(model_dir), tokenizer, prompts, broken, num_generations=2,
                                max_completion_length=2)
    transfer = LocalWeightTransfer(worker)
    transfer.send_weights(iter(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()))
    worker.update_model_version(1)
    worker.start()
    worker._thread.join(30)  # the reward function's error ends the thread
    with pytest.raises(RuntimeError, match="failed") as caught:
        worker.check_health(300.0)
    assert isinstance(caught.value.__cause__, KeyError)
    worker.stop()
    assert not worker.is_alive() and worker.engine.version == 1  # the staged weights were applied as version 1


def test_the_example_trains_stale_steps_at_a_cut_learning_rate():
    path = Path(__file__).parents[1] / "examples" / "trl_async_vcpo.py"
    spec = importlib.util.spec_from_file_location("trl_async_vcpo", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    logs = example.main(steps=3)
    assert len(logs) == 3 and logs[0]["lr_scale"] == pytest.approx(1.0)
    assert any(line["sample/staleness_max"] > 0 and line["lr_scale"] < 1.0 for line in logs)
