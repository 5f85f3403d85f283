"""The study-only mismatch knob (rollout.study_mismatch_std): off leaves the batch as it is; on shifts each
sequence's log-weight by exactly -eps_i, a deterministic draw per (seed, group, row) that ignores rewards, and
a large synchronous batch lands at ESS ratio about exp(-std^2)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from test_learner import batch, tiny_llama
from vcpo.config import load_config
from vcpo.train.learner import Learner
from vcpo.train.mismatch import mismatch_noise, with_study_mismatch
from vcpo.variance import ess_ratio, sequence_log_weights, token_logprobs


def test_off_is_the_batch_itself_and_on_shifts_each_log_weight_by_minus_eps():
    b = batch()
    assert with_study_mismatch(b, 0.0, seed=3) is b
    noisy = with_study_mismatch(b, 0.5, seed=3)
    eps_B = mismatch_noise(b.group_ids_B, 0.5, seed=3)
    lp_BS = torch.randn(b.input_ids_BS.shape, generator=torch.Generator().manual_seed(0))
    before = sequence_log_weights(lp_BS, b.behavior_logprobs_BS, b.response_mask_BS)
    after = sequence_log_weights(lp_BS, noisy.behavior_logprobs_BS, b.response_mask_BS)
    torch.testing.assert_close(after, before - eps_B, rtol=0, atol=1e-5)
    assert eps_B.abs().min() > 0 and not torch.equal(noisy.behavior_logprobs_BS, b.behavior_logprobs_BS)
    # Only counted response tokens move.
    outside = ~b.response_mask_BS.bool()
    assert torch.equal(noisy.behavior_logprobs_BS[outside], b.behavior_logprobs_BS[outside])


def test_noise_is_deterministic_per_seed_and_group_and_ignores_rewards():
    b = batch()
    flipped = with_study_mismatch(dataclasses.replace(b, rewards_B=1.0 - b.rewards_B), 0.5, seed=3)
    assert torch.equal(with_study_mismatch(b, 0.5, seed=3).behavior_logprobs_BS, flipped.behavior_logprobs_BS)
    assert not torch.equal(mismatch_noise(b.group_ids_B, 0.5, 3), mismatch_noise(b.group_ids_B, 0.5, 4))
    # A group's noise does not depend on which other groups share the batch (replay mixes them).
    ids = torch.tensor([5, 5, 9, 9])
    torch.testing.assert_close(mismatch_noise(ids, 1.0, 0)[2:], mismatch_noise(ids[2:], 1.0, 0))
    with pytest.raises(ValueError, match="std"):
        mismatch_noise(ids, -1.0, 0)


def test_a_large_synchronous_batch_sits_at_ess_ratio_exp_minus_std_squared():
    # On-policy (logW = 0 before the noise): logW_i = -eps_i, ESS ratio -> E[W]^2 / E[W^2] = exp(-std^2) = 0.698.
    std, B = 0.6, 8192
    eps_B = mismatch_noise(torch.arange(B) // 8, std, seed=0)
    assert ess_ratio(-eps_B.double()).item() == pytest.approx(math.exp(-std**2), abs=0.02)


def test_the_learner_applies_it_only_when_set():
    b = batch()
    with torch.no_grad():  # on-policy: the behaviour log-probs are the model's own
        lp_BS = token_logprobs(tiny_llama(), b.input_ids_BS, b.attention_mask_BS)
    b = dataclasses.replace(b, behavior_logprobs_BS=torch.where(b.response_mask_BS.bool(), lp_BS, 0.0))
    base = Learner(tiny_llama(), load_config(None, ["objective.name=vcpo", "advantage.estimator=grpo"]))
    noisy = Learner(tiny_llama(), load_config(None, ["objective.name=vcpo", "advantage.estimator=grpo",
                                                     "rollout.study_mismatch_std=0.7"]))
    m_base, m_noisy = base.step(b), noisy.step(b)
    assert m_base["ess/ratio"] == pytest.approx(1.0, abs=1e-5) and m_noisy["ess/ratio"] < 0.9
    assert m_noisy["loss/value"] != m_base["loss/value"]
