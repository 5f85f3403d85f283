"""The rollout engine: log-probs that the learner reproduces, top-p, EOS, seeds, in-flight weight updates."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from vcpo.rollout import HFRolloutEngine, RolloutError, WeightLoadError, sample_next
from vcpo.rollout.engine import cache_kwarg, returned_cache
from vcpo.types import Batch, SamplingParams, Trajectory
from vcpo.variance import token_logprobs

EOS, PAD, VOCAB = 1, 0, 40
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3], [20, 21, 22, 23, 24], [30, 31], [2, 4, 6, 8, 10, 12]]


def tiny_qwen(seed: int = 0, tied: bool = True, attn: str = "sdpa") -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        eos_token_id=EOS,
        pad_token_id=PAD,
        bos_token_id=2,
        tie_word_embeddings=tied,
        attn_implementation=attn,
    )
    return Qwen2ForCausalLM(cfg).float().eval()


def perturbed(model: nn.Module, seed: int, scale: float = 0.1) -> nn.Module:
    """A copy with every (deduplicated, so ties stay tied) parameter shifted by Gaussian noise."""
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return new


def recompute(model: nn.Module, prompts, gens, temperature: float = 1.0) -> list[torch.Tensor]:
    """The learner's view: prompt+response right-padded, plain forward (default positions), shifted gather."""
    seqs = [p + g.response_ids for p, g in zip(prompts, gens, strict=True)]
    ids_BS = torch.full((len(seqs), max(map(len, seqs))), PAD)
    mask_BS = torch.zeros_like(ids_BS)
    for b, s in enumerate(seqs):
        ids_BS[b, : len(s)], mask_BS[b, : len(s)] = torch.tensor(s), 1
    with torch.no_grad():
        logits_BSV = model(input_ids=ids_BS, attention_mask=mask_BS).logits.float() / temperature
    lp_BS = torch.log_softmax(logits_BSV[:, :-1], dim=-1).gather(-1, ids_BS[:, 1:, None]).squeeze(-1)
    return [
        lp_BS[b, len(p) - 1 : len(p) - 1 + len(g.response_ids)]
        for b, (p, g) in enumerate(zip(prompts, gens, strict=True))
    ]


def max_gap(gens, reference) -> float:
    return max(
        (torch.tensor(g.behavior_logprobs) - r).abs().max().item()
        for g, r in zip(gens, reference, strict=True)
        if len(r)
    )


def generate(model, seed=0, poll=None, **sampling):
    params = SamplingParams(**{"max_new_tokens": 12, **sampling})
    engine = HFRolloutEngine(model, eos_id=EOS, pad_id=PAD)
    return engine.generate(PROMPTS, params, weight_poll=poll, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("temperature", "attn"), [(1.0, "sdpa"), (0.7, "sdpa"), (1.0, "eager")])
def test_behavior_logprobs_match_the_learners_recompute(temperature, attn):
    model = tiny_qwen(attn=attn)
    gens = generate(model, temperature=temperature)
    lengths = [len(g.response_ids) for g in gens]
    assert any(g.finished for g in gens) and min(lengths) < 12 == max(lengths)  # left and early-stopped rows
    assert max_gap(gens, recompute(model, PROMPTS, gens, temperature)) < 1e-5  # measured about 2.4e-7


def test_behavior_logprobs_match_token_logprobs_on_a_batch():
    model = tiny_qwen()
    params = SamplingParams(max_new_tokens=12)
    gens = generate(model)
    trajs = [
        Trajectory("u", 0, p, g.response_ids, g.behavior_logprobs, g.versions, 0.0, g.finished, params)
        for p, g in zip(PROMPTS, gens, strict=True)
    ]
    batch = Batch.from_trajectories(trajs, pad_id=PAD)
    with torch.no_grad():
        lp_BS = token_logprobs(model, batch.input_ids_BS, batch.attention_mask_BS)
    gap_BS = (lp_BS - batch.behavior_logprobs_BS).abs() * batch.response_mask_BS
    assert gap_BS.max().item() < 1e-5


def test_same_seed_same_output_other_seed_differs():
    model = tiny_qwen()
    a, b, c = generate(model, seed=1), generate(model, seed=1), generate(model, seed=2)
    assert [g.response_ids for g in a] == [g.response_ids for g in b]
    assert [g.behavior_logprobs for g in a] == [g.behavior_logprobs for g in b]
    assert [g.response_ids for g in a] != [g.response_ids for g in c]


class FixedLM(nn.Module):
    """Returns the same next-token log-probs at every position; counts calls and records what it was fed."""

    def __init__(self, probs: list[float]):
        super().__init__()
        self.logits_V = nn.Parameter(torch.tensor(probs).log())
        self.calls: list[dict] = []

    def forward(self, input_ids, attention_mask, position_ids, past_key_values, use_cache, logits_to_keep):
        self.calls.append({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids})
        logits = self.logits_V.expand(*input_ids.shape, -1)
        return SimpleNamespace(logits=logits, past_key_values=len(self.calls))


@pytest.mark.parametrize(
    ("temperature", "top_p", "nucleus"),
    [
        (1.0, 0.4, {0: 1.0}),  # 0.5 alone reaches 0.4: log-prob 0
        (1.0, 0.7, {0: 0.5 / 0.8, 1: 0.3 / 0.8}),  # mass before token 2 is 0.8 >= 0.7
        (1.0, 0.85, {0: 0.5 / 0.95, 1: 0.3 / 0.95, 2: 0.15 / 0.95}),
        # T = 0.5 squares the probs: [.25, .09, .0225, .0025] / .365; mass before token 2 is .9315 >= .9
        (0.5, 0.9, {0: 0.25 / 0.34, 1: 0.09 / 0.34}),
    ],
)
def test_top_p_samples_inside_the_nucleus_with_renormalised_logprobs(temperature, top_p, nucleus):
    model = FixedLM([0.5, 0.3, 0.15, 0.05])
    engine = HFRolloutEngine(model, eos_id=99, pad_id=0)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=8)
    gens = engine.generate([[3]] * 250, params, generator=torch.Generator().manual_seed(0))
    tokens = [t for g in gens for t in g.response_ids]
    logprobs = [lp for g in gens for lp in g.behavior_logprobs]
    assert len(tokens) == 2000 and set(tokens) <= set(nucleus)
    for t, lp in zip(tokens, logprobs, strict=True):
        assert lp == pytest.approx(math.log(nucleus[t]), abs=1e-6)
    share0 = tokens.count(0) / len(tokens)
    assert share0 == pytest.approx(nucleus[0], abs=0.04)  # 4 standard errors at most


def test_greedy_takes_argmax_with_the_tempered_logprob():
    logits_BV = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    tokens_B, lp_B = sample_next(logits_BV, SamplingParams(temperature=0.5, top_p=0.1), greedy=True)
    assert tokens_B.tolist() == [1, 0]
    # T = 0.5 doubles the logits: row 0 log(e^4 / (1 + e^4 + e^2)), row 1 log(e^6 / (e^6 + 2))
    assert lp_B[0].item() == pytest.approx(4 - math.log(1 + math.exp(4) + math.exp(2)), abs=1e-6)
    assert lp_B[1].item() == pytest.approx(6 - math.log(math.exp(6) + 2), abs=1e-6)


class ScriptedLM(FixedLM):
    """Row b emits ``script[b][step]`` (or token 2 when the script runs out) with probability ~1."""

    def __init__(self, script: list[list[int]]):
        super().__init__([1.0] * 6)
        self.script = script

    def forward(self, input_ids, attention_mask, position_ids, past_key_values, use_cache, logits_to_keep):
        super().forward(input_ids, attention_mask, position_ids, past_key_values, use_cache, logits_to_keep)
        step = len(self.calls) - 1
        logits_BV = torch.zeros(input_ids.shape[0], 6)
        for b, row in enumerate(self.script):
            logits_BV[b, row[step] if step < len(row) else 2] = 100.0
        return SimpleNamespace(logits=logits_BV[:, None], past_key_values=None)


def test_eos_is_recorded_then_the_row_is_padded_and_masked():
    model = ScriptedLM([[5, 1], [5, 4, 3, 4, 3], [1]])
    engine = HFRolloutEngine(model, eos_id=1, pad_id=0)
    gens = engine.generate([[3, 3], [4], [5, 5, 5]], SamplingParams(max_new_tokens=4))
    assert [g.response_ids for g in gens] == [[5, 1], [5, 4, 3, 4], [1]]
    assert [g.finished for g in gens] == [True, False, True]
    assert [len(g.behavior_logprobs) for g in gens] == [2, 4, 1]
    assert all(abs(lp) < 1e-6 for g in gens for lp in g.behavior_logprobs)  # logit margin 100: log-prob ~ -5e-43
    first, last = model.calls[0], model.calls[-1]
    assert first["input_ids"].tolist() == [[0, 3, 3], [0, 0, 4], [5, 5, 5]]  # left padding
    assert first["position_ids"].tolist() == [[0, 0, 1], [0, 0, 0], [0, 1, 2]]
    # step 3 feeds row 1's third token at position 3; finished rows get a masked pad
    assert last["input_ids"].tolist() == [[0], [3], [0]] and last["position_ids"].tolist() == [[4], [3], [5]]
    assert last["attention_mask"].tolist() == [[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]
    # all rows done after step 2: no further forward passes
    done = ScriptedLM([[1], [4, 1]])
    HFRolloutEngine(done, eos_id=1, pad_id=0).generate([[3], [3]], SamplingParams(max_new_tokens=10))
    assert len(done.calls) == 2


def poll_at(call: int, version: int, state_dict):
    calls = []

    def poll():
        calls.append(1)
        return (version, state_dict) if len(calls) == call else None

    return poll, calls


def test_inflight_update_keeps_the_old_kv_cache_and_tags_versions():
    old = tiny_qwen()
    new = perturbed(old, seed=1)
    poll, calls = poll_at(3, 1, new.state_dict())  # applied before the third forward pass
    gens = generate(copy.deepcopy(old), poll=poll)
    assert len(calls) == max(len(g.response_ids) for g in gens)  # one poll per forward pass
    gap_old, gap_new = [], []
    for prompt, g in zip(PROMPTS, gens, strict=True):
        assert g.versions == [0, 0] + [1] * (len(g.response_ids) - 2)
        # Reference: old weights fill the cache for the prompt and token 0, new weights go on from token 1.
        seq = torch.tensor([prompt + g.response_ids])
        with torch.no_grad():
            head = old(input_ids=seq[:, : len(prompt) + 1], use_cache=True)
            tail = new(input_ids=seq[:, len(prompt) + 1 : -1], **cache_kwarg(new, returned_cache(head)))
        logits = torch.cat([head.logits[0, -2:], tail.logits[0]])
        ref = torch.log_softmax(logits, dim=-1).gather(-1, seq[0, len(prompt) :, None]).squeeze(-1)
        assert (torch.tensor(g.behavior_logprobs) - ref).abs().max().item() < 1e-5
        gap_old.append(max_gap([g], recompute(old, [prompt], [g])))
        gap_new.append(max_gap([g], recompute(new, [prompt], [g])))
    # The post-swap tokens are neither the old policy's nor what the new policy would give from scratch.
    assert min(gap_old) > 1e-3 and min(gap_new) > 1e-4


def test_inflight_update_with_identical_weights_changes_only_the_versions():
    model = tiny_qwen()
    plain = generate(copy.deepcopy(model))
    poll, _ = poll_at(3, 7, copy.deepcopy(model).state_dict())
    swapped = generate(copy.deepcopy(model), poll=poll)
    assert [g.response_ids for g in swapped] == [g.response_ids for g in plain]
    assert [g.behavior_logprobs for g in swapped] == [g.behavior_logprobs for g in plain]
    assert swapped[1].versions[:4] == [0, 0, 7, 7]


@pytest.mark.parametrize("tied", [True, False])
def test_load_weights_from_another_instance(tied):
    learner, engine = tiny_qwen(seed=1, tied=tied), HFRolloutEngine(tiny_qwen(seed=2, tied=tied), EOS, PAD)
    engine.load_weights(learner.state_dict(), version=3)
    assert engine.version == 3
    for (name, p), q in zip(learner.state_dict().items(), engine.model.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert tied == (engine.model.lm_head.weight is engine.model.model.embed_tokens.weight)
    params = SamplingParams(max_new_tokens=6)
    reference = HFRolloutEngine(learner, EOS, PAD, version=3).generate(PROMPTS, params, greedy=True)
    assert engine.generate(PROMPTS, params, greedy=True) == reference


def test_load_weights_errors_name_the_key():
    engine = HFRolloutEngine(tiny_qwen(), EOS, PAD)
    sd = tiny_qwen(seed=1).state_dict()
    tied_once = {k: v for k, v in sd.items() if k != "lm_head.weight"}  # as save_pretrained stores it
    engine.load_weights(tied_once, version=1)
    with pytest.raises(WeightLoadError, match="'extra.weight' is not in"):
        engine.load_weights({**sd, "extra.weight": torch.zeros(1)}, version=2)
    with pytest.raises(WeightLoadError, match="no value for 'model.norm.weight'"):
        engine.load_weights({k: v for k, v in sd.items() if k != "model.norm.weight"}, version=2)
    with pytest.raises(WeightLoadError, match="'model.norm.weight' has shape"):
        engine.load_weights({**sd, "model.norm.weight": torch.ones(3)}, version=2)
    untied = tiny_qwen(seed=1, tied=False).state_dict()
    with pytest.raises(WeightLoadError, match="share one tensor"):
        engine.load_weights(untied, version=2)
    assert engine.version == 1  # and the rejected loads wrote nothing:
    assert all(torch.equal(v, engine.model.state_dict()[k]) for k, v in tied_once.items())


@pytest.mark.parametrize(
    ("sampling", "prompts", "match"),
    [
        (SamplingParams(temperature=0.0), [[3]], "temperature"),
        (SamplingParams(top_p=0.0), [[3]], "top_p"),
        (SamplingParams(max_new_tokens=-1), [[3]], "max_new_tokens"),
        (SamplingParams(), [[3], []], r"prompt_ids\[1\]"),
    ],
)
def test_bad_requests_raise_one_clear_error(sampling, prompts, match):
    with pytest.raises(RolloutError, match=match):
        HFRolloutEngine(FixedLM([1.0, 1.0]), eos_id=1, pad_id=0).generate(prompts, sampling)
