"""method="fast" of trajectory_grad_sq_norms (ghost norms) against method="exact", on tiny Qwen2, Llama and GPT-2
models and a hand-built model; the per-row capture's assembled gradient against autograd; the clear refusals."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
import transformers
from torch import nn

from vcpo.variance import ghost_layers, token_logprobs, trajectory_grad_sq_norms
from vcpo.variance.ghost_norms import per_row_grad_capture

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
# Row 0 full; row 1 right-padded by 2; row 2 left-padded by 1. response_mask[:, 0] = 1 must be ignored.
INPUT_IDS = torch.tensor([[3, 17, 8, 41, 22, 9], [5, 30, 12, 7, 0, 0], [0, 11, 2, 48, 33, 6]])
ATTENTION = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]])
RESPONSE = torch.tensor([[1, 0, 0, 1, 1, 1], [1, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1]])
# bfloat16: the fast norms keep half-precision factors (products rounded once, sums in float32); measured 4e-4 to
# 1.3e-3 against the exact bfloat16 norms, which are themselves 2e-3 to 9e-3 from the float32 ones.
TOLERANCE = {F64: 1e-9, F32: 1e-4, BF16: 5e-3}
SMALL = {"vocab_size": 50, "initializer_range": 0.1, "tie_word_embeddings": False}
DECODER = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 64}


def tiny(name: str, dtype: torch.dtype = F64, **overrides) -> nn.Module:
    torch.manual_seed(0)
    config = {**SMALL, **overrides}
    if name == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**DECODER, **config))
    elif name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER, **config))
    else:
        gpt2 = {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 8, "bos_token_id": 1, "eos_token_id": 1,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**gpt2, **config))
    return model.to(dtype).eval()


def rel_err(fast: torch.Tensor, exact: torch.Tensor) -> float:
    return ((fast - exact).abs() / exact.abs().clamp_min(1e-300)).max().item()


MODELS = {
    "qwen2": ("qwen2", {}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True}),
    "llama": ("llama", {}),
    "llama_biases_tied": ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    "gpt2_tied": ("gpt2", {"tie_word_embeddings": True}),
}


@pytest.mark.parametrize("dtype", [F64, F32, BF16])
@pytest.mark.parametrize("which", sorted(MODELS))
def test_fast_matches_exact(which, dtype):
    name, overrides = MODELS[which]
    model = tiny(name, dtype, **overrides)
    exact = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION, method="exact")
    fast = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION, method="fast")
    assert fast.dtype == F64 and fast.shape == (3,) and (exact > 0).all()
    assert rel_err(fast, exact) < TOLERANCE[dtype]


def test_norms_of_selected_rows_only():
    model = tiny("llama", F64, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)
    full, capture = per_row_grad_capture(model, INPUT_IDS, RESPONSE, ATTENTION)
    for rows in (torch.tensor([False, True, True]), torch.tensor([2, 0])):
        picked = per_row_grad_capture(model, INPUT_IDS, RESPONSE, ATTENTION, rows=rows)[0]
        keep = torch.zeros(3, dtype=torch.bool)
        keep[rows] = True
        torch.testing.assert_close(picked[keep], full[keep], rtol=1e-12, atol=0)
        assert (picked[~keep] == 0).all()
        torch.testing.assert_close(capture.sq_norms(rows), picked, rtol=1e-12, atol=0)
    assert (capture.sq_norms(torch.zeros(3, dtype=torch.bool)) == 0).all()
    torch.testing.assert_close(capture.sq_norms(torch.ones(3, dtype=torch.bool)), full, rtol=0, atol=0)
    with pytest.raises(ValueError, match="bool mask must have shape"):
        capture.sq_norms(torch.ones(2, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [F64, F32])
def test_rms_norm_weight_with_zero_entries(dtype):
    # x_hat is the norm's output divided by its weight, except where a weight entry is (near) zero: recomputed.
    model = tiny("llama", dtype)
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight[3] = 0.0
        model.model.layers[1].post_attention_layernorm.weight[5] = 1e-9
        model.model.norm.weight.mul_(-0.5)
    exact = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION, method="exact")
    fast = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION, method="fast")
    assert rel_err(fast, exact) < TOLERANCE[dtype]


def test_rms_norm_form_checked_on_the_first_call_only(monkeypatch):
    # The check against the module's output costs more than the rest of the hook; the weight still changes.
    model = tiny("llama")
    checks = []
    allclose = torch.allclose
    monkeypatch.setattr(ghost_layers.torch, "allclose", lambda *a, **k: checks.append(1) or allclose(*a, **k))
    trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION, method="fast")
    first = len(checks)
    assert first >= 5  # the final norm and two per layer
    with torch.no_grad():
        model.model.norm.weight.mul_(-0.5)
        model.model.layers[0].input_layernorm.weight[3] = 0.0
    fast = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION, method="fast")
    assert len(checks) == first
    exact = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION, method="exact")
    assert rel_err(fast, exact) < TOLERANCE[F64]


@pytest.mark.parametrize("gram", [True, False])
def test_gram_and_materialised_forms_agree_with_exact(monkeypatch, gram):
    # Tied: the shared weight's Gram / materialised forms both mix the embedding's one-hot rows with the head.
    model = tiny("qwen2", tie_word_embeddings=True)
    monkeypatch.setattr(ghost_layers, "prefer_gram", lambda *_: gram)
    fast = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION, method="fast")
    exact = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION, method="exact")
    assert rel_err(fast, exact) < 1e-9


def test_zero_response_row_frozen_parameters_and_grad_untouched():
    model = tiny("qwen2")
    model.model.embed_tokens.weight.requires_grad_(False)
    model.model.layers[0].requires_grad_(False)
    sentinel = torch.randn_like(model.lm_head.weight)
    model.lm_head.weight.grad = sentinel.clone()
    response = RESPONSE.clone()
    response[1] = 0
    fast = trajectory_grad_sq_norms(model, INPUT_IDS, response, ATTENTION, method="fast")
    exact = trajectory_grad_sq_norms(model, INPUT_IDS, response, ATTENTION, method="exact")
    assert fast[1].item() == 0.0
    assert rel_err(fast[[0, 2]], exact[[0, 2]]) < 1e-9
    torch.testing.assert_close(model.lm_head.weight.grad, sentinel, rtol=0.0, atol=0.0)
    assert all(p.grad is None for n, p in model.named_parameters() if n != "lm_head.weight")


@pytest.mark.parametrize(("which", "dtype", "tolerance"), [("qwen2_tied", F64, 1e-10), ("gpt2_tied", F32, 1e-6)])
def test_accumulate_grad_equals_autograd_of_weighted_scores(which, dtype, tolerance):
    name, overrides = MODELS[which]
    model = tiny(name, dtype, **overrides)
    # Powers of two: Qwen2RMSNorm runs in float32 even in a float64 model, so the backward of sum_b c_b score_b
    # rounds differently from c_b times each row's backward unless scaling by c_b is exact (then it is 1e-16).
    coef_B = torch.tensor([0.5, -2.0, 0.25], dtype=dtype)
    G_B, capture = per_row_grad_capture(model, INPUT_IDS, RESPONSE, ATTENTION)
    assert all(p.grad is None for p in model.parameters())
    logp_BT = token_logprobs(model, INPUT_IDS, ATTENTION)
    score_B = torch.where(RESPONSE[:, 1:].bool(), logp_BT[:, 1:], torch.zeros_like(logp_BT[:, 1:])).sum(1)
    torch.testing.assert_close(capture.logprobs_BT, logp_BT.detach())
    (coef_B * score_B).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # accumulate_grad adds to what is there
    capture.accumulate_grad(coef_B)
    for n, p in model.named_parameters():
        diff = (p.grad - 1.0 - expected[n]).norm() / expected[n].norm()
        assert diff < tolerance, n
    exact = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION)
    assert rel_err(G_B, exact) < TOLERANCE[dtype]


@pytest.mark.parametrize("which", ["llama_biases_tied", "gpt2_tied"])
def test_accumulate_grad_in_bfloat16_keeps_half_factors_and_matches_autograd(which):
    name, overrides = MODELS[which]
    model = tiny(name, BF16, **overrides)
    coef_B = torch.tensor([0.5, -2.0, 0.25])
    _, capture = per_row_grad_capture(model, INPUT_IDS, RESPONSE, ATTENTION)
    logp_BT = token_logprobs(model, INPUT_IDS, ATTENTION)
    score_B = torch.where(RESPONSE[:, 1:].bool(), logp_BT[:, 1:], torch.zeros_like(logp_BT[:, 1:])).sum(1)
    (coef_B * score_B).sum().backward()
    expected = {n: p.grad.float() for n, p in model.named_parameters()}
    model.zero_grad()
    capture.accumulate_grad(coef_B)
    # Both are bfloat16 computations that round differently; measured at most 0.6% on one parameter.
    for n, p in model.named_parameters():
        assert p.grad.dtype == BF16 and (p.grad.float() - expected[n]).norm() < 1e-2 * expected[n].norm(), n


def test_capture_with_a_float32_head_matches_per_row_autograd():
    """lm_head_fp32: the capture computes the logits in float32 from the bfloat16 body and records that product as
    the head's call; its norms match per-row autograd through the same float32-head log-probs."""
    model = tiny("llama", BF16, tie_word_embeddings=True)
    params = list(model.parameters())
    G_B, capture = per_row_grad_capture(model, INPUT_IDS, RESPONSE, ATTENTION, lm_head_fp32=True)
    logp_BT = token_logprobs(model, INPUT_IDS, ATTENTION, lm_head_fp32=True)
    torch.testing.assert_close(capture.logprobs_BT, logp_BT.detach(), rtol=0, atol=1e-5)
    expected = []
    for b in range(3):
        score = torch.where(RESPONSE[b, 1:].bool(), logp_BT[b, 1:], torch.zeros_like(logp_BT[b, 1:])).sum()
        grads = torch.autograd.grad(score, params, retain_graph=True)
        expected.append(sum(g.double().square().sum() for g in grads))
    assert rel_err(G_B, torch.stack(expected)) < 5e-3


class HandBuiltLM(nn.Module):
    """Embedding (padding row) -> torch RMSNorm -> a Linear called twice with causal averaging -> LayerNorm -> head."""

    def __init__(self, misuse: str = ""):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 16, padding_idx=0)
        self.norm = nn.RMSNorm(16)
        self.mix = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)
        self.head = nn.Linear(16, 50, bias=False)
        self.misuse = misuse
        self.double()

    def forward(self, input_ids, attention_mask=None):
        h = self.norm(self.embed(input_ids))
        steps = torch.arange(1, h.shape[1] + 1, dtype=h.dtype)[:, None]
        h = torch.tanh(self.mix(h)).cumsum(1) / steps
        mixed = self.mix(h)
        if self.misuse == "in_place":
            mixed.mul_(2.0)
        h = self.ln(h + mixed)
        logits = h @ self.embed.weight.T if self.misuse == "functional_tie" else self.head(h)
        return SimpleNamespace(logits=logits)


def test_hand_built_model_with_a_module_called_twice():
    model = HandBuiltLM()
    fast = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, method="fast")
    exact = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, method="exact")
    assert rel_err(fast, exact) < 1e-9


@pytest.mark.parametrize(
    ("misuse", "pattern"),
    [("functional_tie", "'embed.weight' is used outside"), ("in_place", "modified in place")],
)
def test_unaccounted_use_raises(misuse, pattern):
    with pytest.raises(NotImplementedError, match=pattern):
        trajectory_grad_sq_norms(HandBuiltLM(misuse), INPUT_IDS, RESPONSE, method="fast")


class ShiftedRMSNorm(nn.Module):
    """An RMSNorm look-alike whose output is not weight * x_hat."""

    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) + 0.1


def test_unsupported_modules_raise_naming_the_parameter():
    model = tiny("qwen2")
    model.model.extra = nn.Conv1d(2, 2, 1)
    with pytest.raises(NotImplementedError, match=r"'model.extra.weight' of a Conv1d"):
        trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION, method="fast")
    model = tiny("qwen2")
    model.model.norm = ShiftedRMSNorm(32).double()
    with pytest.raises(NotImplementedError, match="ShiftedRMSNorm is not y = weight"):
        trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION, method="fast")
    model = tiny("qwen2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable()
    exact = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION)
    # Hugging Face checkpoints only in training mode: in eval mode the capture sees every activation.
    assert rel_err(trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION, method="fast"), exact) < 1e-9
    with pytest.raises(NotImplementedError, match="gradient checkpointing"):
        trajectory_grad_sq_norms(model.train(), INPUT_IDS, RESPONSE, ATTENTION, method="fast")
    _, capture = per_row_grad_capture(tiny("qwen2"), INPUT_IDS, RESPONSE, ATTENTION)
    with pytest.raises(ValueError, match=r"coef_B \(2,\)"):
        capture.accumulate_grad(torch.ones(2, dtype=F64))
