"""Lean log-probs (chunked LM head over the needed positions) against the full [B, S, V] path: values,
entropies and gradients; the float32 LM head; models whose logits are not a Linear head of their hidden states."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from torch import nn

from vcpo.rollout import HFRolloutEngine
from vcpo.types import SamplingParams
from vcpo.variance import logprobs as L
from vcpo.variance import token_logprobs

IDS = torch.tensor([[5, 9, 33, 2, 17, 250, 8, 41], [7, 3, 99, 120, 4, 0, 0, 0], [12, 13, 14, 15, 16, 17, 18, 19]])
ATTENTION = (IDS != 0).long()
POSITIONS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1, 1, 0]])


def tiny(dtype: torch.dtype = torch.float32, tied: bool = True, bias: bool = False) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(cfg)
    if bias:  # a head with a bias: the lean path's bias gradient
        model.lm_head = nn.Linear(32, 300, bias=True)
    return model.to(dtype).eval()


@pytest.fixture
def lean_always(monkeypatch):
    """Take the lean path at any size, in chunks of 3 tokens (so that several chunks run)."""
    monkeypatch.setattr(L, "LEAN_MIN_LOGITS", 0)
    monkeypatch.setattr(L, "CHUNK_LOGITS", 3 * 300)


def grads_of(model: nn.Module, **kwargs) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    lp, entropy = token_logprobs(model, IDS, ATTENTION, return_entropy=True, **kwargs)
    weights = torch.linspace(-1.0, 2.0, IDS.numel()).view_as(lp)  # a loss with a different weight per token
    (weights * lp * POSITIONS).sum().backward()
    return lp.detach(), entropy, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(("tied", "bias"), [(True, False), (False, True)])
def test_lean_path_equals_the_full_path(lean_always, dtype, tolerance, temperature, tied, bias):
    model = tiny(dtype, tied, bias)
    lp_full, ent_full, g_full = grads_of(model, temperature=temperature)
    lp_lean, ent_lean, g_lean = grads_of(model, temperature=temperature, positions=POSITIONS)
    m = POSITIONS.bool()
    assert lp_lean.dtype == lp_full.dtype
    assert (lp_lean - lp_full)[m].abs().max() < tolerance * 10
    assert (ent_lean - ent_full)[m].abs().max() < tolerance * 10
    assert lp_lean[~m].abs().max() == 0 and ent_lean[~m].abs().max() == 0  # positions not asked for: 0
    for a, b in zip(g_full, g_lean, strict=True):
        assert (a - b).norm() <= tolerance * a.norm()


def test_small_batches_keep_the_full_path():
    model = tiny()
    lp = token_logprobs(model, IDS, ATTENTION, positions=POSITIONS)
    assert lp[~POSITIONS.bool()].abs().sum() > 0  # the full path computes every position (3 x 7 x 300 < 2^24)


def test_float32_head_brings_bfloat16_log_probs_closer_to_float32():
    reference = token_logprobs(tiny(torch.float32), IDS, ATTENTION, positions=POSITIONS)
    model = tiny(torch.bfloat16)
    half = token_logprobs(model, IDS, ATTENTION, positions=POSITIONS)
    fp32_head = token_logprobs(model, IDS, ATTENTION, positions=POSITIONS, lm_head_fp32=True)
    m = POSITIONS.bool()
    assert fp32_head.dtype == torch.float32
    # bfloat16 logits near 5 are rounded by up to 2^-6; a float32 head keeps only the body's rounding.
    assert (fp32_head - reference)[m].abs().max() < (half - reference)[m].abs().max()
    fp32_head.sum().backward()
    assert model.lm_head.weight.grad.dtype == torch.bfloat16


class ScaledLogits(nn.Module):
    """A model whose logits are its head's times 2: no body/head split."""

    def __init__(self):
        super().__init__()
        self.inner = tiny()
        self.base_model = self.inner.model

    def get_output_embeddings(self):
        return self.inner.lm_head

    def forward(self, input_ids, attention_mask=None, **kwargs):
        return SimpleNamespace(logits=2.0 * self.inner(input_ids=input_ids, attention_mask=attention_mask).logits)


def test_models_without_a_plain_head_take_the_full_path(lean_always):
    model = ScaledLogits()
    assert L.split_head(model) is None and L.split_head(tiny()) is not None
    logits = model(IDS, ATTENTION).logits
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, IDS[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(model, IDS, ATTENTION, positions=POSITIONS)[:, 1:], expected)
    with pytest.raises(NotImplementedError, match="ScaledLogits"):
        token_logprobs(model, IDS, ATTENTION, lm_head_fp32=True)


def engine_learner_gap(model: nn.Module, fp32: bool) -> float:
    """Largest |engine log-prob - learner log-prob| over 6 sampled tokens of 3 prompts, same weights."""
    prompts = [[5, 9, 33], [7, 3], [12, 13, 14, 15]]
    engine = HFRolloutEngine(model, eos_id=1, pad_id=0, lm_head_fp32=fp32)
    gens = engine.generate(prompts, SamplingParams(max_new_tokens=6), generator=torch.Generator().manual_seed(0))
    rows = [p + g.response_ids for p, g in zip(prompts, gens, strict=True)]
    S = max(map(len, rows))
    ids = torch.tensor([r + [0] * (S - len(r)) for r in rows])
    attention = torch.tensor([[1] * len(r) + [0] * (S - len(r)) for r in rows])
    lp = token_logprobs(model, ids, attention, lm_head_fp32=fp32)
    return max((torch.tensor(g.behavior_logprobs) - lp[b, len(p) : len(p) + len(g.response_ids)]).abs().max().item()
               for b, (p, g) in enumerate(zip(prompts, gens, strict=True)))


def test_engine_and_learner_agree_with_a_float32_head():
    assert engine_learner_gap(tiny(), fp32=True) < 1e-5  # float32 weights: the option changes nothing
    # A bfloat16 body rounds differently in the cached decode and the full forward on some CPUs and not on others
    # (measured: gap 0 with the bfloat16 head and 4.8e-7 with the float32 one on one VM; 9.6e-4 and 3.5e-4 on an AMD
    # EPYC VM; 0 and 4.8e-7 again on another EPYC VM on 2026-11-27), as on GPUs (tests/gpu). What holds everywhere:
    # the float32 head removes the head's own rounding, so it never widens the gap by more than float32 rounding
    # (the 4.8e-7 above, where the bfloat16 paths happen to agree exactly), and both stay far below a
    # sampling-relevant size.
    bf16_head = engine_learner_gap(tiny(torch.bfloat16), False)
    fp32_head = engine_learner_gap(tiny(torch.bfloat16), True)
    assert bf16_head < 1e-2 and fp32_head < 1e-2 and fp32_head <= bf16_head + 1e-5
