"""vcpo.variance: ESS and the ESS-scaled LR, OPOB (both weightings), the group advantage estimators
and trajectory_grad_sq_norms against a brute-force per-row gradient."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from vcpo.variance import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    dr_grpo_advantages,
    ess,
    ess_lr_scale,
    ess_ratio,
    grpo_advantages,
    opo_advantages,
    opob_advantages,
    opob_baseline,
    opob_rows_needing_grad_norms,
    rloo_advantages,
    sequence_log_weights,
    token_logprobs,
    trajectory_grad_sq_norms,
)

from conftest import LN2

F64 = torch.float64


def t64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def ids(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


# ---------------------------------------------------------------- importance weights and ESS


def test_sequence_log_weights_masked_positions_ignored():
    # Row 0: (−1 − −2) + (−1 − −1) = 1; row 1: only token 0 counts, −3 − −1 = −2 (inf behind the mask).
    lp = t64([[-1.0, -1.0], [-3.0, float("inf")]])
    blp = t64([[-2.0, -1.0], [-1.0, 0.0]])
    m = t64([[1, 1], [1, 0]])
    torch.testing.assert_close(sequence_log_weights(lp, blp, m), t64([1.0, -2.0]))


def test_ess_hand_values():
    # Uniform weights: (B w)^2 / (B w^2) = B, whatever the common value.
    assert ess(torch.full((8,), 3.7, dtype=F64)).item() == pytest.approx(8.0)
    # W = [1, 2]: (1 + 2)^2 / (1 + 4) = 9/5; rho = 9/10.
    assert ess(t64([0.0, LN2])).item() == pytest.approx(9 / 5)
    assert ess_ratio(t64([0.0, LN2])).item() == pytest.approx(9 / 10)
    # One dominant weight: W = [1, e^-50 x 3] -> ESS = (1 + 3e^-50)^2 / (1 + 3e^-100) ~ 1.
    assert ess(t64([0.0, -50.0, -50.0, -50.0])).item() == pytest.approx(1.0)


def test_ess_extreme_log_weights_are_finite():
    # +-1e4: the 1e4 term dominates completely, ESS = 1 exactly.
    e = ess(t64([1e4, -1e4, 0.0]))
    assert math.isfinite(e.item())
    assert e.item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="1-D"):
        ess(torch.zeros(2, 2))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4), min_size=1, max_size=32), st.sampled_from([torch.float32, F64]))
def test_ess_finite_and_in_range_property(logw, dtype):
    e = ess(torch.tensor(logw, dtype=dtype)).item()
    assert math.isfinite(e)
    assert 1 - 1e-5 <= e <= len(logw) * (1 + 1e-5)


def test_ess_lr_scale_rules():
    # sqrt(min(1, 0.25 / 1)) = 0.5; linear = 0.25.
    assert ess_lr_scale(0.25) == pytest.approx(0.5)
    assert ess_lr_scale(0.25, rule="linear") == pytest.approx(0.25)
    # Multi-turn reference 0.55: rho 0.275 -> sqrt(0.5); rho 0.6 > 0.55 -> capped at 1.
    assert ess_lr_scale(0.275, reference=0.55) == pytest.approx(math.sqrt(0.5))
    assert ess_lr_scale(0.6, reference=0.55) == 1.0
    assert ess_lr_scale(0.0) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"rho": -0.1}, "rho"),
        ({"rho": float("nan")}, "rho"),
        ({"rho": 0.5, "reference": 0.0}, "reference"),
        ({"rho": 0.5, "rule": "cubic"}, "valid rules"),
    ],
)
def test_ess_lr_scale_errors(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ess_lr_scale(**kwargs)


# ---------------------------------------------------------------- OPOB


def test_opob_two_groups_by_hand():
    # Non-contiguous ids 7 and -3, interleaved.
    # Group 7 (rows 0, 2, 3): W = [1, 2, 1] -> W^2 = [1, 4, 1]; G = [1, 1, 2] -> w = [1, 4, 2];
    #   R = [1, 0, 1] -> b = (1 + 0 + 2) / 7 = 3/7.
    # Group -3 (rows 1, 4): W = [3, 1] -> W^2 = [9, 1]; G = [1, 3] -> w = [9, 3];
    #   R = [2, 0] -> b = 18 / 12 = 1.5.
    group_ids = ids([7, -3, 7, 7, -3])
    rewards = t64([1.0, 2.0, 0.0, 1.0, 0.0])
    logw = t64([0.0, math.log(3.0), LN2, 0.0, 0.0])
    g = t64([1.0, 1.0, 1.0, 2.0, 3.0])
    b = opob_baseline(rewards, logw, g, group_ids)
    torch.testing.assert_close(b, t64([3 / 7, 1.5, 3 / 7, 3 / 7, 1.5]))
    # sigma (population): group 7 mean 2/3, var = (1/9 + 4/9 + 1/9)/3 = 2/9 -> sqrt(2)/3;
    #   group -3 mean 1, var 1 -> 1.
    # Ahat: R = 1 -> (4/7) * 3/sqrt2 = 12/(7 sqrt2); R = 0 -> -(3/7) * 3/sqrt2 = -9/(7 sqrt2);
    #   group -3: [2 - 1.5, 0 - 1.5] = [0.5, -1.5].
    s2 = math.sqrt(2.0)
    a = opob_advantages(rewards, logw, g, group_ids)
    torch.testing.assert_close(a, t64([12 / (7 * s2), 0.5, -9 / (7 * s2), 12 / (7 * s2), -1.5]))


def test_rows_needing_grad_norms_are_those_of_groups_whose_rewards_differ():
    group_ids = ids([7, -3, 7, 2, -3, 2, 9])
    rewards = t64([1.0, 0.0, 1.0, 0.5, 1.0, 0.25, 3.0])  # 7: equal; -3: differ; 2: differ; 9: a single row
    expected = torch.tensor([False, True, False, True, True, True, False])
    assert torch.equal(opob_rows_needing_grad_norms(rewards, group_ids), expected)
    assert torch.equal(opob_rows_needing_grad_norms(rewards.float(), group_ids), expected)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["paper", "authors_code"]))
def test_opob_advantages_ignore_the_norms_of_equal_reward_groups(seed, weighting):
    # Binary rewards in groups of 4: zeroing G outside the needed rows changes no advantage, bit for bit.
    g = torch.Generator().manual_seed(seed)
    group_ids = torch.arange(6).repeat_interleave(4)
    rewards = (torch.rand(24, generator=g) < 0.3).to(F64)
    rewards[:4] = 1.0  # at least one group of equal rewards
    logw = torch.randn(24, generator=g, dtype=F64) * 3
    norms = torch.rand(24, generator=g, dtype=F64) * 10
    needed = opob_rows_needing_grad_norms(rewards, group_ids)
    assert not needed[:4].any()
    full = opob_advantages(rewards, logw, norms, group_ids, weighting=weighting)
    skipped = opob_advantages(rewards, logw, torch.where(needed, norms, 0.0), group_ids, weighting=weighting)
    assert torch.equal(full, skipped) and (full[~needed] == 0).all()


def test_opob_equal_weights_is_group_mean():
    # Equal W and equal G cancel: b_g is the plain group mean, Ahat = (R - mean_g) / sigma_g.
    group_ids = ids([0, 0, 0, 5, 5])
    rewards = t64([1.0, 0.0, 0.5, 3.0, -1.0])
    logw, g = torch.full((5,), 2.5, dtype=F64), torch.full((5,), 3.0, dtype=F64)
    b = opob_baseline(rewards, logw, g, group_ids)
    torch.testing.assert_close(b, t64([0.5, 0.5, 0.5, 1.0, 1.0]))
    a = opob_advantages(rewards, logw, g, group_ids)
    sigma = t64([rewards[:3].std(unbiased=False)] * 3 + [rewards[3:].std(unbiased=False)] * 2)
    torch.testing.assert_close(a, (rewards - b) / sigma)


def test_opob_stable_for_log_weights_of_1000():
    # Group 0: logw [1000, -1000, 0], G = 1: the first weight dominates by e^1000 -> b = R_0 = 2.
    # Group 1: logw [-1000, -1000], G = [1, 3]: after the shift w = [1, 3] -> b = (0 + 12) / 4 = 3.
    b = opob_baseline(
        t64([2.0, 5.0, 7.0, 0.0, 4.0]), t64([1000.0, -1000.0, 0.0, -1000.0, -1000.0]),
        t64([1.0, 1.0, 1.0, 1.0, 3.0]), ids([0, 0, 0, 1, 1]),
    )
    torch.testing.assert_close(b, t64([2.0, 2.0, 2.0, 3.0, 3.0]))


def test_opob_zero_or_non_finite_denominator_falls_back_to_group_mean():
    # Group 0: all G = 0 -> mean(1, 3) = 2. Group 1: an infinite log-weight -> mean(0, 6) = 3.
    # Group 2: one G = 0 only drops that row: b = R of the other row = 10.
    rewards = t64([1.0, 3.0, 0.0, 6.0, 10.0, -4.0])
    logw = t64([0.0, 0.0, float("inf"), 0.0, 0.0, 0.0])
    g = t64([0.0, 0.0, 1.0, 1.0, 2.0, 0.0])
    b = opob_baseline(rewards, logw, g, ids([0, 0, 1, 1, 2, 2]))
    torch.testing.assert_close(b, t64([2.0, 2.0, 3.0, 3.0, 10.0, 10.0]))
    # Zero reward variance in group 0 of the advantages: sigma = 0 -> Ahat = R - b = 0.
    a = opob_advantages(t64([1.0, 1.0]), t64([0.0, 0.0]), t64([0.0, 0.0]), ids([0, 0]))
    torch.testing.assert_close(a, t64([0.0, 0.0]))


def test_opob_authors_code_weighting_by_hand():
    # W = [1, 2, 4], G = 1, R = [0, 1, 2].
    # paper: w = W^2 = [1, 4, 16] -> b = (0 + 4 + 32) / 21 = 12/7.
    # authors_code, cap 2: w = W^2 min(W, 2)^2 = [1, 16, 64] -> b = (16 + 128) / 81 = 16/9.
    # authors_code, cap 8: w = W^4 = [1, 16, 256] -> b = (16 + 512) / 273 = 176/91.
    rewards, logw, g, group_ids = t64([0.0, 1.0, 2.0]), t64([0.0, LN2, 2 * LN2]), t64([1.0] * 3), ids([0] * 3)
    assert opob_baseline(rewards, logw, g, group_ids)[0].item() == pytest.approx(12 / 7)
    assert opob_baseline(rewards, logw, g, group_ids, weighting="authors_code", cap=2.0)[0].item() == pytest.approx(
        16 / 9
    )
    assert opob_baseline(rewards, logw, g, group_ids, weighting="authors_code")[0].item() == pytest.approx(176 / 91)
    # Ahat with authors_code: sigma = sqrt(2/3); R - 176/91 scaled by it.
    a = opob_advantages(rewards, logw, g, group_ids, weighting="authors_code")
    torch.testing.assert_close(a, (rewards - 176 / 91) / math.sqrt(2 / 3))


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"weighting": "w4"}, "valid weightings: paper, authors_code"),
        ({"weighting": "authors_code", "cap": 0.0}, "cap"),
        ({"grad_sq_norms": t64([-1.0, 1.0])}, "grad_sq_norms"),
        ({"logw": t64([0.0, 0.0, 0.0])}, r"logw \(3,\)"),
        ({"group_ids": t64([0.0, 1.0])}, "group_ids must be an integer"),
    ],
)
def test_opob_errors(kwargs, pattern):
    args = {"rewards": t64([1.0, 0.0]), "logw": t64([0.0, 0.0]), "grad_sq_norms": t64([1.0, 1.0]),
            "group_ids": ids([0, 0])}
    args.update(kwargs)
    with pytest.raises(ValueError, match=pattern):
        opob_baseline(**args)


_opob_rows = st.tuples(
    st.integers(0, 3),
    st.floats(-1000, 1000),
    st.one_of(st.just(0.0), st.floats(1e-6, 1e6)),
    st.floats(-5, 5),
)


@settings(max_examples=80, deadline=None)
@given(st.lists(_opob_rows, min_size=1, max_size=12), st.sampled_from(["paper", "authors_code"]))
def test_opob_finite_and_a_convex_combination_property(rows, weighting):
    group_ids, logw, g, rewards = (list(c) for c in zip(*rows, strict=True))
    r = t64(rewards)
    b = opob_baseline(r, t64(logw), t64(g), ids(group_ids), weighting=weighting)
    a = opob_advantages(r, t64(logw), t64(g), ids(group_ids), weighting=weighting)
    assert torch.isfinite(b).all() and torch.isfinite(a).all()
    # b_g is a weighted mean (or the plain mean) of the group's rewards.
    for gid in set(group_ids):
        in_g = ids(group_ids) == gid
        assert (b[in_g] >= r[in_g].min() - 1e-9).all() and (b[in_g] <= r[in_g].max() + 1e-9).all()


# ---------------------------------------------------------------- group advantage estimators

# Group 4: R = [3, 0, 0, 1] (mean 1); group 9: R = [5] alone; group 2: R = [1, 3] (mean 2).
RW = t64([3.0, 0.0, 1.0, 5.0, 0.0, 1.0, 3.0])
GIDS = ids([4, 4, 2, 9, 4, 4, 2])
LENGTHS = t64([1.0, 2.0, 3.0, 5.0, 3.0, 4.0, 1.0])


def test_grpo_advantages_by_hand():
    # Group 4: deviations [2, -1, -1, 0], sample var (4 + 1 + 1 + 0)/3 = 2 -> std sqrt2.
    # Group 2: deviations [-1, 1], sample var 2/1 -> std sqrt2. Singleton: 0 / eps = 0.
    s2 = math.sqrt(2.0) + 1e-6
    expected = t64([2 / s2, -1 / s2, -1 / s2, 0.0, -1 / s2, 0 / s2, 1 / s2])
    torch.testing.assert_close(grpo_advantages(RW, GIDS), expected)
    with pytest.raises(ValueError, match="eps"):
        grpo_advantages(RW, GIDS, eps=0.0)


def test_dr_grpo_advantages_by_hand():
    # R - mean_g: group 4 -> [2, -1, -1, 0]; group 2 -> [-1, 1]; singleton -> 0.
    torch.testing.assert_close(dr_grpo_advantages(RW, GIDS), t64([2.0, -1.0, -1.0, 0.0, -1.0, 0.0, 1.0]))


def test_rloo_advantages_by_hand():
    # Group 4 (sum 4): R_i - (4 - R_i)/3 -> 3 - 1/3 = 8/3, 0 - 4/3, 0 - 4/3, 1 - 3/3 = 0.
    # Group 2: [1 - 3, 3 - 1] = [-2, 2]. Singleton: 0.
    expected = t64([8 / 3, -4 / 3, -2.0, 0.0, -4 / 3, 0.0, 2.0])
    torch.testing.assert_close(rloo_advantages(RW, GIDS), expected)


def test_opo_advantages_by_hand():
    # Group 4: L = [1, 2, 3, 4], R = [3, 0, 0, 1]: b = (3 + 0 + 0 + 4)/10 = 0.7 -> [2.3, -0.7, -0.7, 0.3].
    # Group 2: L = [3, 1], R = [1, 3]: b = (3 + 3)/4 = 1.5 -> [-0.5, 1.5]. Singleton: b = R -> 0.
    expected = t64([2.3, -0.7, -0.5, 0.0, -0.7, 0.3, 1.5])
    torch.testing.assert_close(opo_advantages(RW, GIDS, LENGTHS), expected)
    # Zero total length falls back to the plain mean.
    torch.testing.assert_close(opo_advantages(t64([1.0, 3.0]), ids([0, 0]), t64([0.0, 0.0])), t64([-1.0, 1.0]))
    with pytest.raises(ValueError, match="lengths"):
        opo_advantages(RW, GIDS, -LENGTHS)


def test_compute_advantages_dispatch():
    assert sorted(ADVANTAGE_ESTIMATORS) == ["dr_grpo", "grpo", "opo", "opob", "rloo"]
    torch.testing.assert_close(compute_advantages("rloo", RW, GIDS, lengths=LENGTHS), rloo_advantages(RW, GIDS))
    torch.testing.assert_close(compute_advantages("opo", RW, GIDS, lengths=LENGTHS), opo_advantages(RW, GIDS, LENGTHS))
    torch.testing.assert_close(compute_advantages("grpo", RW, GIDS, eps=1e-3), grpo_advantages(RW, GIDS, eps=1e-3))
    logw, g = torch.linspace(-1, 1, 7, dtype=F64), torch.linspace(0.5, 2, 7, dtype=F64)
    torch.testing.assert_close(
        compute_advantages("opob", RW, GIDS, logw=logw, grad_sq_norms=g, weighting="authors_code"),
        opob_advantages(RW, logw, g, GIDS, weighting="authors_code"),
    )


@pytest.mark.parametrize(
    ("name", "kwargs", "pattern"),
    [
        ("opo", {}, "'lengths'"),
        ("opob", {"logw": torch.zeros(7, dtype=F64)}, "'grad_sq_norms'"),
        ("opob", {"grad_sq_norms": torch.ones(7, dtype=F64)}, "'logw'"),
        ("ppo", {}, "valid names: dr_grpo, grpo, opo, opob, rloo"),
    ],
)
def test_compute_advantages_errors(name, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        compute_advantages(name, RW, GIDS, **kwargs)


def test_estimators_reject_mismatched_shapes():
    with pytest.raises(ValueError, match=r"rewards \(7,\).*group_ids \(3,\)"):
        dr_grpo_advantages(RW, ids([0, 0, 1]))


# ---------------------------------------------------------------- trajectory_grad_sq_norms


def tiny_qwen2(tie: bool = False) -> torch.nn.Module:
    import transformers
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, tie_word_embeddings=tie, initializer_range=0.1,
    )
    return transformers.Qwen2ForCausalLM(config).double()


def unique_trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Each trainable Parameter once, by identity (a tied weight is listed twice by remove_duplicate=False)."""
    by_id = {id(p): p for _, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return list(by_id.values())


def brute_force_sq_norms(model, input_ids, response_mask, attention_mask, params) -> torch.Tensor:
    """One batched forward, log-probs via cross-entropy, per-row gradients by one-hot row weighting."""
    B, T = input_ids.shape
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    nll = F.cross_entropy(logits[:, :-1].reshape(B * (T - 1), -1), input_ids[:, 1:].reshape(-1), reduction="none")
    score_B = -(nll.view(B, T - 1) * response_mask[:, 1:]).sum(dim=1)
    norms = []
    for b in range(B):
        onehot_B = F.one_hot(torch.tensor(b), B).to(score_B)
        grads = torch.autograd.grad((onehot_B * score_B).sum(), params, retain_graph=True)
        flat = torch.cat([g.reshape(-1) for g in grads])
        norms.append(flat @ flat)
    return torch.stack(norms)


# Row 0 full; row 1 right-padded by 2; row 2 left-padded by 1. response_mask[:, 0] = 1 must be ignored.
INPUT_IDS = torch.tensor([[3, 17, 8, 41, 22, 9], [5, 30, 12, 7, 0, 0], [0, 11, 2, 48, 33, 6]])
ATTENTION = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]])
RESPONSE = torch.tensor([[1, 0, 0, 1, 1, 1], [1, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1]])


def test_token_logprobs_matches_cross_entropy():
    model = tiny_qwen2()
    lp = token_logprobs(model, INPUT_IDS, ATTENTION)
    logits = model(input_ids=INPUT_IDS, attention_mask=ATTENTION).logits
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, 50), INPUT_IDS[:, 1:].reshape(-1), reduction="none")
    assert (lp[:, 0] == 0).all()
    torch.testing.assert_close(lp[:, 1:], -nll.view(3, 5))


def test_exact_grad_sq_norms_match_brute_force():
    model = tiny_qwen2()
    g = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION)
    expected = brute_force_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION, unique_trainable(model))
    assert g.shape == (3,) and (g > 0).all()
    torch.testing.assert_close(g, expected, rtol=1e-9, atol=0.0)


def test_right_padded_row_equals_the_unpadded_row():
    model = tiny_qwen2()
    g = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION)
    alone = trajectory_grad_sq_norms(model, INPUT_IDS[1:2, :4], RESPONSE[1:2, :4])
    torch.testing.assert_close(g[1:2], alone, rtol=1e-9, atol=0.0)


def test_tied_embeddings_count_once():
    model = tiny_qwen2(tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    g = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION)
    once = brute_force_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION, unique_trainable(model))
    torch.testing.assert_close(g, once, rtol=1e-9, atol=0.0)
    # Counting the tied weight twice (remove_duplicate=False) gives a strictly larger value.
    every_name = [p for _, p in model.named_parameters(remove_duplicate=False)]
    twice = brute_force_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION, every_name)
    assert (twice > g * (1 + 1e-6)).all()


def test_frozen_parameters_excluded_and_grad_untouched():
    model = tiny_qwen2()
    model.model.embed_tokens.weight.requires_grad_(False)
    sentinel = torch.randn_like(model.lm_head.weight)
    model.lm_head.weight.grad = sentinel.clone()
    g = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION)
    expected = brute_force_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION, unique_trainable(model))
    torch.testing.assert_close(g, expected, rtol=1e-9, atol=0.0)
    torch.testing.assert_close(model.lm_head.weight.grad, sentinel, rtol=0.0, atol=0.0)
    assert all(p.grad is None for n, p in model.named_parameters() if n != "lm_head.weight")


def test_all_zero_response_row_has_zero_norm():
    model = tiny_qwen2()
    response = RESPONSE.clone()
    response[0] = 0
    assert trajectory_grad_sq_norms(model, INPUT_IDS, response, ATTENTION)[0].item() == 0.0


def test_grad_sq_norms_errors():
    model = tiny_qwen2()
    with pytest.raises(ValueError, match="valid methods: exact"):
        trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, method="ghost")
    with pytest.raises(ValueError, match=r"response_mask \(3, 5\)"):
        trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE[:, :5])
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE)
