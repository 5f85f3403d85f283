"""method="fast" of trajectory_grad_sq_norms (ghost norms) against method="exact", on tiny Qwen2, Llama and GPT-2
models and a hand-built model; the per-row capture's assembled gradient against autograd; the clear refusals."""

from __future__ import annotations

import copy
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn

from vcpo.variance import ghost_layers, token_logprobs, trajectory_grad_sq_norms
from vcpo.variance.ghost_norms import per_row_grad_capture

from conftest import run_ranks

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
    # the capture's head runs over the response tokens only (0 elsewhere, as token_logprobs' lean path gives)
    lean_BT = token_logprobs(model, INPUT_IDS, ATTENTION, positions=RESPONSE, lm_head_fp32=True)
    torch.testing.assert_close(capture.logprobs_BT, lean_BT.detach(), rtol=0, atol=1e-5)
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


def _sharded_norms(rank: int, world_size: int, port: int, results: str) -> None:
    """One FSDP2 rank: each HandBuiltLM's fast norms (or the refusal), the model sharded as one unit."""
    from torch.distributed.fsdp import fully_shard

    from vcpo.train.data_parallel import init_process_group

    torch.set_num_threads(1)
    init_process_group(rank, world_size, "127.0.0.1", port, timeout_s=120)
    try:
        out = {}
        for misuse in ("", "functional_tie"):
            model = HandBuiltLM(misuse)
            fully_shard(model)
            try:
                out[misuse] = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, method="fast")
            except NotImplementedError as error:
                out[misuse] = str(error)
        torch.save(out, results)
    finally:
        dist.destroy_process_group()


def test_unaccounted_use_raises_under_fsdp2_too(tmp_path):
    """Under FSDP2 the graph holds the unsharded copies of the parameters, not the sharded ones the plan knows: the
    guard matches them through what each module held during its call (one gloo rank)."""
    results = str(tmp_path / "rank0.pt")
    run_ranks(_sharded_norms, 1, results)
    out = torch.load(results)
    exact = trajectory_grad_sq_norms(HandBuiltLM(), INPUT_IDS, RESPONSE, method="exact")
    assert rel_err(out[""], exact) < 1e-9
    assert out["functional_tie"] == ("fast grad norms: parameter 'embed.weight' is used outside the modules that "
                                     "own it; use method='exact'")


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


# The chunked head (vcpo.variance.ghost_head), forced on these tiny batches: every response token's head in
# vocabulary slices of 7 (so the online log-sum-exp rescales its running sums 8 times over a vocabulary of 50) and
# blocks of 2 rows (so a batch of 3 takes two blocks), and the same comparisons against the exact method.
@pytest.fixture
def chunked_head(monkeypatch):
    from vcpo.variance import ghost_head, logprobs

    monkeypatch.setattr(logprobs, "LEAN_MIN_LOGITS", 0)
    monkeypatch.setattr(ghost_head, "VOCAB_CHUNK", 7)
    monkeypatch.setattr(ghost_head, "CHUNK_LOGITS", 2 * 4 * 7)


class BiasHeadLM(nn.Module):
    """A Llama body with an untied LM head that has a bias (Hugging Face heads have none)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        body = tiny("llama", dtype)
        self.model, self.lm_head = body.model, nn.Linear(32, 50, bias=True).to(dtype)
        with torch.no_grad():
            self.lm_head.bias.normal_(0.0, 0.5)
        self.config = body.config

    @property
    def base_model(self) -> nn.Module:
        return self.model

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)
        return SimpleNamespace(logits=self.lm_head(hidden.last_hidden_state))


def _lean_models(dtype: torch.dtype) -> dict[str, nn.Module]:
    return {**{which: tiny(name, dtype, **overrides) for which, (name, overrides) in MODELS.items()},
            "bias_head": BiasHeadLM(dtype).eval()}


@pytest.mark.parametrize("dtype", [F64, F32, BF16])
def test_the_chunked_head_matches_exact_for_every_model(chunked_head, dtype):
    for which, model in _lean_models(dtype).items():
        exact = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION, method="exact")
        G_B, capture = per_row_grad_capture(model, INPUT_IDS, RESPONSE, ATTENTION)
        assert any(type(t).__name__ == "HeadTerm" for _, terms in capture.terms for t in terms), which
        assert rel_err(G_B, exact) < TOLERANCE[dtype], which
        lean_BT = token_logprobs(model, INPUT_IDS, ATTENTION, positions=RESPONSE)
        torch.testing.assert_close(capture.logprobs_BT, lean_BT.detach(), rtol=0, atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("gram", [True, False])
def test_the_chunked_path_pools_weights_and_vectors_exactly(monkeypatch, chunked_head, dtype, gram):
    """The chunked path sums its norms pooled (q/k/v materialised side by side when they are half precision, norm
    weights and biases side by side): equal to the exact norms in either form of the dense weights."""
    monkeypatch.setattr(ghost_layers, "prefer_gram", lambda *_: gram)
    for which in ("qwen2_tied", "llama"):
        model = _lean_models(dtype)[which]
        G_B, capture = per_row_grad_capture(model, INPUT_IDS, RESPONSE, ATTENTION)
        assert capture.lengths_B is not None, which
        exact = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION, method="exact")
        assert rel_err(G_B, exact) < TOLERANCE[dtype], which


def _weighted_score_grads(model: nn.Module, coef_B: torch.Tensor) -> dict[str, torch.Tensor]:
    """Autograd's gradient of ``sum_b coef_b score_b`` (the lean path's log-probs), in float64."""
    model.zero_grad()
    logp_BT = token_logprobs(model, INPUT_IDS, ATTENTION, positions=RESPONSE)
    (coef_B.to(logp_BT.dtype) * logp_BT[:, 1:].sum(1)).sum().backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("dtype", [F64, BF16])
def test_the_chunked_heads_weighted_gradient_equals_autograd(chunked_head, dtype):
    coef_B = torch.tensor([0.5, -2.0, 0.25], dtype=dtype)
    for which, model in _lean_models(dtype).items():
        _, capture = per_row_grad_capture(model, INPUT_IDS, RESPONSE, ATTENTION)
        expected = _weighted_score_grads(model, coef_B)
        capture.accumulate_grad(coef_B)
        if dtype == F64:  # the same sums in another order
            for n, p in model.named_parameters():
                assert (p.grad - expected[n]).norm() <= 1e-9 * expected[n].norm(), (which, n)
            continue
        # bfloat16: both round differently (the capture's hidden-state gradient is float32, rounded once); each is
        # judged against the float64 gradient of the same weights: the capture no further from it than autograd's
        # own bfloat16 gradient, give or take 1% (measured: both up to 3.0-3.4% off, 0.5% apart at most)
        truth = _weighted_score_grads(copy.deepcopy(model).double(), coef_B)
        for n, p in model.named_parameters():
            assert p.grad.dtype == dtype, (which, n)
            ours, theirs = ((g.double() - truth[n]).norm() / truth[n].norm() for g in (p.grad, expected[n]))
            assert ours <= theirs + 1e-2, (which, n, float(ours), float(theirs))


def test_the_chunked_head_with_confident_tokens_a_temperature_and_selected_rows(chunked_head):
    """Tokens the model predicts with p near 1 (where g . g expanded through p . p would cancel), sampling at
    T = 0.7, the head frozen or not, and norms asked for some rows first, the others later."""
    for dtype, tolerance in ((F64, 1e-9), (F32, 1e-4), (BF16, 5e-3)):
        model = tiny("qwen2", dtype, tie_word_embeddings=True)
        with torch.no_grad():  # sharp logits, each response token the model's own argmax: mostly p > 0.99
            model.model.norm.weight.mul_(30.0)
            ids = INPUT_IDS.clone()
            for t in range(1, ids.shape[1]):
                ids[:, t] = torch.where(RESPONSE[:, t].bool(), model(ids).logits[:, t - 1].argmax(-1), ids[:, t])
            lp = token_logprobs(model, ids, ATTENTION, positions=RESPONSE)
        assert lp[RESPONSE.bool() & (torch.arange(6) > 0)].exp().median() > 0.99
        exact = trajectory_grad_sq_norms(model, ids, RESPONSE, ATTENTION, method="exact")
        G_B, _ = per_row_grad_capture(model, ids, RESPONSE, ATTENTION)
        assert rel_err(G_B, exact) < tolerance, dtype
    model = tiny("llama", F64, tie_word_embeddings=True)
    params = list(model.parameters())
    logp_BT = token_logprobs(model, INPUT_IDS, ATTENTION, temperature=0.7)
    expected = []
    for b in range(3):
        score = torch.where(RESPONSE[b, 1:].bool(), logp_BT[b, 1:], torch.zeros_like(logp_BT[b, 1:])).sum()
        expected.append(sum(g.square().sum() for g in torch.autograd.grad(score, params, retain_graph=True)))
    G_B, capture = per_row_grad_capture(model, INPUT_IDS, RESPONSE, ATTENTION, temperature=0.7,
                                        rows=torch.tensor([True, False, True]))
    assert G_B[1] == 0 and rel_err(G_B[[0, 2]], torch.stack(expected)[[0, 2]]) < 1e-9
    assert rel_err(capture.sq_norms(), torch.stack(expected)) < 1e-9  # row 1's head Gram on demand
    model.lm_head.weight.requires_grad_(False)  # tied: the embedding too (LoRA's frozen base, say)
    frozen = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION, method="fast")
    assert rel_err(frozen, trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION)) < 1e-9


def test_norms_trim_each_row_to_its_gradient_carrying_tokens(monkeypatch, chunked_head):
    """Rows of different lengths (on the chunked-head path, which large batches take): each chunk of rows is
    trimmed to its longest row's last response position, in the Gram and the materialised forms alike, and the norms
    do not change."""
    from vcpo.variance.ghost_norms import gradient_lengths

    assert gradient_lengths(RESPONSE).tolist() == [5, 3, 5]
    # 8 is within 2 x of 9; 4 is not (a new chunk); 3 is within 2 x of 4
    assert [(c.rows, c.n) for c in ghost_layers.row_chunks([9, 8, 4, 4, 3], None)] == [
        (slice(0, 2), 9), (slice(2, 5), 4)]
    assert [(c.rows, c.n) for c in ghost_layers.row_chunks([9, 8, 4, 4, 3], None, max_ratio=1.25)] == [
        (slice(0, 2), 9), (slice(2, 4), 4), (slice(4, 5), 3)]
    assert [c.n for c in ghost_layers.row_chunks([9, 8, 7], 1 << 24)] == [9, 8, 7]  # one row fills the budget
    model = tiny("llama", F64, tie_word_embeddings=True)
    ids = torch.cat([INPUT_IDS, torch.zeros(3, 4, dtype=torch.long)], 1)  # 4 positions of padding after every row
    pad = lambda t: torch.cat([t, torch.zeros(3, 4, dtype=t.dtype)], 1)  # noqa: E731
    exact = trajectory_grad_sq_norms(model, INPUT_IDS, RESPONSE, ATTENTION)
    for gram in (True, False):
        monkeypatch.setattr(ghost_layers, "prefer_gram", lambda *_, gram=gram: gram)
        G_B, capture = per_row_grad_capture(model, ids, pad(RESPONSE), pad(ATTENTION))
        assert capture.lengths_B.tolist() == [5, 3, 5] and rel_err(G_B, exact) < 1e-9
