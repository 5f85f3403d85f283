"""Per-token log-probs (and entropies, collision probabilities) of a Hugging Face causal LM, in float32 whatever
the weights' dtype.

Two paths give the same numbers: the full one (the model's [B, S, V] logits, one log-softmax), kept for small
batches so that their numerics never change, and a lean one for large batches and for a float32 LM head: the
model body's hidden states, then the LM head, log-sum-exp and gather over the needed positions only, a chunk of
tokens at a time, recomputed chunk by chunk in the backward. No [B, S, V] tensor exists on the lean path.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

LEAN_MIN_LOGITS = 1 << 24
"""Positions x vocabulary from which the lean path is taken (64 MiB of float32 logits). Below it the full path
runs: it is as fast there, and the default CPU runs keep their exact numerics."""

CHUNK_LOGITS = 1 << 25
"""Logits per chunk of the lean path (128 MiB in float32; the backward holds about three such tensors)."""

_HALF = (torch.bfloat16, torch.float16)
_SPLITS: weakref.WeakKeyDictionary[nn.Module, tuple[nn.Module, nn.Linear] | None] = weakref.WeakKeyDictionary()


def split_head(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """``(body, head)`` with ``model(ids).logits == head(body(ids).last_hidden_state)``, or None.

    The body is Hugging Face's ``base_model`` and the head ``get_output_embeddings()``, an ``nn.Linear``. Models that
    transform the logits further (soft-capping, a logit scale) have no such split, nor does a sharded model (FSDP2:
    its head's weight is whole only inside the model's own forward). Checked once per model on a short slice of one
    row, against the model's own logits (the check runs a forward: call it outside hooks).
    """
    if model in _SPLITS:
        return _SPLITS[model]
    body = getattr(model, "base_model", None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    config = getattr(model, "config", None)
    scaled = any(getattr(config, key, None) is not None for key in ("final_logit_softcapping", "logit_scale"))
    split = None
    sharded = isinstance(head, nn.Linear) and isinstance(head.weight, DTensor)
    if isinstance(body, nn.Module) and body is not model and isinstance(head, nn.Linear) and not scaled and not sharded:
        ids = torch.arange(3, 7, device=head.weight.device)[None] % head.out_features
        try:
            with torch.no_grad():
                full = model(input_ids=ids, use_cache=False).logits.float()
                lean = head(body(input_ids=ids, use_cache=False).last_hidden_state).float()
        except TypeError:  # not a Hugging Face signature: no split assumed
            full = lean = None
        if full is not None and full.shape == lean.shape and torch.allclose(full, lean, rtol=1e-4, atol=1e-5):
            split = (body, head)
    _SPLITS[model] = split
    return split


def head_logits(head: nn.Linear, hidden: Tensor, fp32: bool = False) -> Tensor:
    """``head(hidden)``; with ``fp32`` and half-precision weights, computed in float32 from the hidden states and
    weights upcast (no rounding of the logits to half precision)."""
    if not fp32 or head.weight.dtype not in _HALF:
        return head(hidden)
    bias = None if head.bias is None else head.bias.float()
    return F.linear(hidden.float(), head.weight.float(), bias)


def logprobs_from_logits(
    logits_BSV: Tensor, input_ids: Tensor, temperature: float = 1.0, return_entropy: bool = False,
    return_collision: bool = False,
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """[B, S] log-probs of ``input_ids`` from the logits of every position (position 0 gets 0), the log-softmax in
    at least float32; with ``return_entropy`` also the detached [B, S] entropy (0 at position 0); with
    ``return_collision`` the entropy and the detached [B, S] collision probability ``sum_v p_v^2`` (0 at 0)."""
    # Half-precision log-softmax over a large vocabulary loses most of a token's log-prob.
    logits_BTV = logits_BSV[:, :-1].to(torch.promote_types(logits_BSV.dtype, torch.float32))
    if temperature != 1.0:
        logits_BTV = logits_BTV / temperature
    logp_BTV = torch.log_softmax(logits_BTV, dim=-1)
    logp_BT = F.pad(logp_BTV.gather(-1, input_ids[:, 1:, None]).squeeze(-1), (1, 0), value=0.0)
    if not (return_entropy or return_collision):
        return logp_BT
    with torch.no_grad():
        p_BTV = logp_BTV.exp()
        entropy_BT = F.pad(-(p_BTV * logp_BTV).sum(-1), (1, 0), value=0.0)
        if not return_collision:
            return logp_BT, entropy_BT
        return logp_BT, entropy_BT, F.pad(p_BTV.square().sum(-1), (1, 0), value=0.0)


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """``lp_n = z_n[target_n] - logsumexp(z_n)``, ``z_n = head(h_n) / T``, chunk by chunk; the backward recomputes each
    chunk's logits: ``d lp / d z = (onehot(target) - softmax(z)) / T``."""

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, bias_V, targets_N, temperature, fp32, want_entropy, want_collision):
        compute = torch.float32 if fp32 and weight_VD.dtype in _HALF else weight_VD.dtype
        acc = torch.promote_types(compute, torch.float32)
        weight, bias = weight_VD.to(compute), None if bias_V is None else bias_V.to(compute)
        n, step = hidden_ND.shape[0], max(1, CHUNK_LOGITS // weight_VD.shape[0])
        lp_N = hidden_ND.new_empty(n, dtype=acc)
        lse_N = hidden_ND.new_empty(n, dtype=acc)
        entropy_N = hidden_ND.new_zeros(n if want_entropy else 0, dtype=acc)
        collision_N = hidden_ND.new_zeros(n if want_collision else 0, dtype=acc)
        for s in range(0, n, step):
            z = F.linear(hidden_ND[s : s + step].to(compute), weight, bias).to(acc) / temperature
            lse = torch.logsumexp(z, dim=-1)
            lse_N[s : s + step] = lse
            lp_N[s : s + step] = z.gather(1, targets_N[s : s + step, None]).squeeze(1) - lse
            if want_entropy or want_collision:
                p = torch.exp(z - lse[:, None])
                if want_entropy:  # H = lse - sum_v p_v z_v
                    entropy_N[s : s + step] = lse - (p * z).sum(-1)
                if want_collision:
                    collision_N[s : s + step] = p.square().sum(-1)
        ctx.save_for_backward(hidden_ND, weight_VD, bias_V, targets_N, lse_N)
        ctx.temperature, ctx.compute, ctx.step = temperature, compute, step
        ctx.mark_non_differentiable(entropy_N, collision_N)
        return lp_N, entropy_N, collision_N

    @staticmethod
    def backward(ctx, grad_lp_N, _grad_entropy, _grad_collision):
        hidden_ND, weight_VD, bias_V, targets_N, lse_N = ctx.saved_tensors
        compute, step, temperature = ctx.compute, ctx.step, ctx.temperature
        acc = lse_N.dtype
        weight, bias = weight_VD.to(compute), None if bias_V is None else bias_V.to(compute)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden_ND) if need_h else None
        grad_w = torch.zeros(weight_VD.shape, dtype=acc, device=weight_VD.device) if need_w else None
        grad_b = torch.zeros(weight_VD.shape[0], dtype=acc, device=weight_VD.device) if need_b else None
        for s in range(0, hidden_ND.shape[0], step):
            h = hidden_ND[s : s + step].to(compute)
            z = F.linear(h, weight, bias).to(acc) / temperature
            g = grad_lp_N[s : s + step].to(acc)[:, None]
            dz = -torch.exp(z - lse_N[s : s + step, None]) * g
            dz.scatter_add_(1, targets_N[s : s + step, None], g)
            dz = (dz / temperature).to(compute)
            if need_h:
                grad_h[s : s + step] = dz @ weight
            if need_w:
                grad_w += dz.T @ h
            if need_b:
                grad_b += dz.sum(0)
        grad_w = grad_w.to(weight_VD.dtype) if need_w else None
        grad_b = grad_b.to(weight_VD.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _lean_logprobs(
    body: nn.Module, head: nn.Linear, input_ids: Tensor, attention_mask: Tensor | None, temperature: float,
    positions_BS: Tensor, return_entropy: bool, fp32: bool, return_collision: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    hidden_BSD = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    # Token t is predicted by the hidden state at t - 1: only the positions asked for get a head.
    rows, cols = positions_BS[:, 1:].bool().nonzero(as_tuple=True)
    lp_N, entropy_N, collision_N = _ChunkedHeadLogprobs.apply(
        hidden_BSD[rows, cols], head.weight, head.bias, input_ids[rows, cols + 1], temperature, fp32, return_entropy,
        return_collision,
    )
    lp_BS = lp_N.new_zeros(input_ids.shape).index_put((rows, cols + 1), lp_N)
    entropy_BS = entropy_N.new_zeros(input_ids.shape).index_put((rows, cols + 1), entropy_N) if return_entropy else None
    collision_BS = (collision_N.new_zeros(input_ids.shape).index_put((rows, cols + 1), collision_N)
                    if return_collision else None)
    return lp_BS, entropy_BS, collision_BS


def token_logprobs(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None, temperature: float = 1.0,
    return_entropy: bool = False, positions: Tensor | None = None, lm_head_fp32: bool = False,
    return_collision: bool = False,
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """[B, T] ``log p_theta(input_ids[b, t] | input_ids[b, <t])`` of a Hugging Face causal LM.

    The log-prob of token t comes from the logits at position t - 1; position 0 has no logits that
    predict it and is set to 0. Logits are divided by ``temperature`` (the learner uses the rollout
    temperature, so its log-probs are of the distribution the engine sampled). The log-softmax runs
    in at least float32 (float64 models stay float64). Differentiable: gradients flow into the
    model's parameters. With ``return_entropy`` also returns the detached [B, T] entropy of the
    distribution that predicted each token (0 at position 0). With ``return_collision`` returns
    ``(log-probs, entropy, collision)``, the last the detached [B, T] ``sum_v p_v^2`` of that distribution (0 at
    position 0), from the same softmax (the logit proxy of OPOB's G, ``logit_proxy_grad_sq_norms``).

    ``positions`` ([B, T], optional) names the tokens whose log-probs are needed; when it holds at least
    ``LEAN_MIN_LOGITS`` logits (or ``lm_head_fp32`` is set) and the model splits into body and head
    (``split_head``), the lean path computes those only (others are 0) without any [B, T, V] tensor.
    ``lm_head_fp32`` computes the logits in float32 from half-precision weights (``head_logits``).
    """
    check_token_tensors(input_ids, attention_mask=attention_mask, positions=positions)
    if positions is None and lm_head_fp32:
        positions = torch.ones_like(input_ids)
    if positions is not None:
        split = split_head(model)
        lean = lm_head_fp32 or int(positions[:, 1:].count_nonzero()) * _vocab(model, split) >= LEAN_MIN_LOGITS
        if lean and split is not None:
            lp_BT, entropy_BT, collision_BT = _lean_logprobs(
                *split, input_ids, attention_mask, temperature, positions, return_entropy or return_collision,
                lm_head_fp32, return_collision,
            )
            if return_collision:
                return lp_BT, entropy_BT, collision_BT
            return (lp_BT, entropy_BT) if return_entropy else lp_BT
        if lm_head_fp32:
            raise NotImplementedError(
                f"lm_head_fp32: {type(model).__name__}'s logits are not a Linear head of its hidden states"
            )
    from transformers import PreTrainedModel  # here: importing transformers costs seconds, objectives need none

    # No KV cache to build (and none that activation checkpointing would have to refuse).
    no_cache = {"use_cache": False} if isinstance(model, PreTrainedModel) else {}
    logits_BTV = model(input_ids=input_ids, attention_mask=attention_mask, **no_cache).logits
    return logprobs_from_logits(logits_BTV, input_ids, temperature, return_entropy, return_collision)


def _vocab(model: nn.Module, split: tuple[nn.Module, nn.Linear] | None) -> int:
    if split is not None:
        return split[1].out_features
    return int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)


def check_token_tensors(input_ids: Tensor, **others: Tensor | None) -> None:
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty [B, T] tensor, got shape {tuple(input_ids.shape)}")
    for name, t in others.items():
        if t is not None and t.shape != input_ids.shape:
            raise ValueError(
                f"{name} {tuple(t.shape)} must have the shape of input_ids {tuple(input_ids.shape)}"
            )
