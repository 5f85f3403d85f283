"""Micro-batches: the plan under a token budget, the whole-batch normalisers, and gradients equal to the
full-batch ones for every registered objective and loss_agg, with and without OPOB (fast and exact norms)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from test_e2e_cli import metrics, vcpo
from vcpo.config import load_config
from vcpo.objectives import LOSS_AGG_MODES, list_objectives, normaliser_count, objective_hyperparameters
from vcpo.train.learner import Learner
from vcpo.train.micro_batches import WholeBatch, gather_rows, plan_micro_batches, trim_padding
from vcpo.types import Batch, SamplingParams, Trajectory
from vcpo.variance import token_logprobs

BUDGET = 24  # rows of up to 11 tokens: two rows, or one group of 4 alone (over budget), per micro-batch


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg).eval()


MODEL = tiny_llama()


def make_batch(seed: int = 0, rows: int = 12, group: int = 4) -> Batch:
    """Three groups of 4; prompts of 2-5 tokens, responses of 0-6 (an empty one included); behavior log-probs the
    model's own plus N(0, 0.3) noise, so that ratios spread around 1 and clipping/masking objectives act."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(rows):
        p = torch.randint(3, 40, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        r = torch.randint(3, 40, (int(torch.randint(0, 7, (1,), generator=g)),), generator=g).tolist()
        reward = float(torch.rand(1, generator=g) > 0.5)
        trajs.append(Trajectory("u", i // group, p, r, [0.0] * len(r), [0] * len(r), reward, True, SamplingParams()))
    batch = Batch.from_trajectories(trajs, pad_id=0)
    with torch.no_grad():
        lp_BS = token_logprobs(MODEL, batch.input_ids_BS, batch.attention_mask_BS)
    noise_BS = 0.3 * torch.randn(lp_BS.shape, generator=g)
    batch.behavior_logprobs_BS = torch.where(batch.response_mask_BS.bool(), lp_BS + noise_BS, 0.0)
    return batch


BATCH = make_batch()


def test_plan_packs_longest_first_under_the_budget():
    lengths = torch.tensor([5, 3, 8, 2])
    # Rows: 8 alone (2 x 8 > 10), then 5 and 3 (2 x 5 = 10), then 2.
    plan = plan_micro_batches(lengths, torch.tensor([0, 0, 1, 1]), 10, keep_groups=False)
    assert [p.tolist() for p in plan] == [[2], [0, 1], [3]]
    # Groups: group 1 (longest 8, 2 x 8 = 16 > 10) alone over the budget, then group 0 (2 x 5 = 10).
    plan = plan_micro_batches(lengths, torch.tensor([0, 0, 1, 1]), 10, keep_groups=True)
    assert [p.tolist() for p in plan] == [[2, 3], [0, 1]]
    assert [p.tolist() for p in plan_micro_batches(lengths, torch.zeros(4), None, True)] == [[0, 1, 2, 3]]


def test_whole_batch_counts_and_scales():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert float(normaliser_count(mask, "token-mean")) == 3.0  # counted tokens
    assert float(normaliser_count(mask, "seq-mean-token-mean")) == 2.0  # rows with a counted token
    assert float(normaliser_count(mask, "seq-mean-token-sum-norm")) == 3.0  # rows
    whole = WholeBatch.of(mask, "token-mean")
    assert whole.loss_scale(mask[:1]) == pytest.approx(2 / 3)  # 2 of the 3 tokens
    assert whole.loss_scale(mask[1:2]) == pytest.approx(1 / 3)  # an empty part: max(0, 1) / 3; its loss is 0
    parts = [(torch.tensor([2, 0]), torch.tensor([[5.0], [6.0]])), (torch.tensor([1]), torch.tensor([[7.0, 8.0]]))]
    assert gather_rows(parts, 3, 2).tolist() == [[6.0, 0.0], [7.0, 8.0], [5.0, 0.0]]


def test_trim_padding_cuts_to_the_longest_row():
    sub = BATCH.rows(torch.tensor([0, 1]))
    trimmed = trim_padding(sub)
    assert trimmed.input_ids_BS.shape[1] == int(sub.attention_mask_BS.sum(1).max()) < sub.input_ids_BS.shape[1]
    assert torch.equal(trimmed.rewards_B, sub.rewards_B)


def step_grads(overrides: list[str], budget: int | None, max_len: int | None = None):
    extra = [] if max_len is None else [f"objective.max_len={max_len}"]  # Dr. GRPO's constant
    cfg = load_config(None, [*overrides, *extra, f"trainer.micro_batch_tokens={'null' if budget is None else budget}"])
    learner = Learner(copy.deepcopy(MODEL), cfg)
    metrics = learner.backward(BATCH)
    grads = [p.grad for p in learner.optimizer.updated]
    return grads, metrics, learner


def assert_same_update(overrides: list[str], max_len: int | None = None) -> None:
    full, m_full, _ = step_grads(overrides, None, max_len)
    micro, m_micro, learner = step_grads(overrides, BUDGET, max_len)
    plan = plan_micro_batches(BATCH.attention_mask_BS.sum(1), BATCH.group_ids_B, BUDGET,
                              "advantage.estimator=opob" in overrides or learner.scope != "row")
    assert len(plan) >= 3
    assert any(g.norm() > 0 for g in full)
    for gf, gm in zip(full, micro, strict=True):
        assert (gm - gf).norm().item() <= 1e-6 * gf.norm().item()
    for key, value in m_full.items():  # the objective's diagnostics are those of the whole batch
        if not key.startswith("time/"):
            assert m_micro[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("objective", list_objectives())
def test_every_objective_and_loss_agg_micro_batched_equals_full_batch(objective, loss_agg):
    assert_same_update([f"objective.name={objective}", f"objective.loss_agg={loss_agg}", "advantage.estimator=grpo"],
                       max_len=8 if loss_agg == "seq-mean-token-sum-norm" else None)


@pytest.mark.parametrize("method", ["fast", "exact"])
@pytest.mark.parametrize("objective", list_objectives())
def test_every_objective_with_opob_micro_batched_equals_full_batch(objective, method):
    assert objective_hyperparameters(objective)["loss_agg"] in LOSS_AGG_MODES
    assert_same_update([f"objective.name={objective}", "advantage.estimator=opob",
                        f"advantage.grad_norm_method={method}"])


@pytest.mark.parametrize("variant", ["plugin", "leave_one_out", "grad_only"])
def test_the_chunked_head_learner_step_equals_exact_norms_full_and_micro_batched(monkeypatch, variant):
    """The chunked-head capture (forced here; large batches take it) through Learner.backward: the VCPO update with
    fast norms equals the one with exact per-row norms, on the whole batch and over micro-batches."""
    from vcpo.variance import ghost_head, logprobs

    monkeypatch.setattr(logprobs, "LEAN_MIN_LOGITS", 0)
    monkeypatch.setattr(ghost_head, "VOCAB_CHUNK", 7)
    monkeypatch.setattr(ghost_head, "CHUNK_LOGITS", 3 * 6 * 7)
    arm = ["objective.name=vcpo", "advantage.estimator=opob", f"advantage.opob_variant={variant}"]
    exact, m_exact, _ = step_grads([*arm, "advantage.grad_norm_method=exact"], None)
    for budget in (None, BUDGET):
        fast, m_fast, _ = step_grads([*arm, "advantage.grad_norm_method=fast"], budget)
        assert m_fast["opob/grad_sq_norm_mean"] == pytest.approx(m_exact["opob/grad_sq_norm_mean"], rel=1e-5)
        for ge, gf in zip(exact, fast, strict=True):
            assert (gf - ge).norm().item() <= 1e-5 * ge.norm().item()


def test_cli_lagged_run_micro_batched_equals_full_batch(tmp_path):
    """Issue 11's check: 5 lagged steps on the CPU with micro-batches of 64 tokens (four here) match the
    full-batch run's losses, gradient norms and rewards within 1e-5 relative."""
    common = ["-c", "configs/quickstart.yaml", f"sft.cache_dir={tmp_path / 'cache'}", "sft.steps=30",
              "sft.batch_size=32", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
              "task.eval_size=16", "trainer.eval_every=0", "trainer.checkpoint_every=0", "logging.progress=false",
              "trainer.lr=1e-3", "async.mode=lagged", "async.max_staleness=2", "trainer.max_steps=5",
              "model.device=cpu"]
    vcpo("train", *common, f"run_dir={tmp_path / 'full'}")
    vcpo("train", *common, f"run_dir={tmp_path / 'micro'}", "trainer.micro_batch_tokens=64")
    full, micro = metrics(tmp_path / "full"), metrics(tmp_path / "micro")
    assert [m["step"] for m in micro] == [1, 2, 3, 4, 5]
    for mf, mm in zip(full, micro, strict=True):
        for key in ("loss/value", "grad_norm", "reward/mean", "ess/ratio", "adv/abs_mean"):
            assert mm[key] == pytest.approx(mf[key], rel=1e-5, abs=1e-12), (mf["step"], key)
