"""Per-token log-probs of a Hugging Face causal LM and the per-trajectory squared score-gradient
norms ``G_i`` that OPOB weights by (VCPO, arXiv 2602.17616, §8.3)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _check_token_tensors(input_ids: Tensor, **others: Tensor | None) -> None:
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty [B, T] tensor, got shape {tuple(input_ids.shape)}")
    for name, t in others.items():
        if t is not None and t.shape != input_ids.shape:
            raise ValueError(
                f"{name} {tuple(t.shape)} must have the shape of input_ids {tuple(input_ids.shape)}"
            )


def token_logprobs(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None, temperature: float = 1.0,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """[B, T] ``log p_theta(input_ids[b, t] | input_ids[b, <t])`` of a Hugging Face causal LM.

    The log-prob of token t comes from the logits at position t - 1; position 0 has no logits that
    predict it and is set to 0. Logits are divided by ``temperature`` (the learner uses the rollout
    temperature, so its log-probs are of the distribution the engine sampled). The log-softmax runs
    in at least float32 (float64 models stay float64). Differentiable: gradients flow into the
    model's parameters. With ``return_entropy`` also returns the detached [B, T] entropy of the
    distribution that predicted each token (0 at position 0).
    """
    _check_token_tensors(input_ids, attention_mask=attention_mask)
    logits_BTV = model(input_ids=input_ids, attention_mask=attention_mask).logits
    # Half-precision log-softmax over a large vocabulary loses most of a token's log-prob.
    logits_BTV = logits_BTV[:, :-1].to(torch.promote_types(logits_BTV.dtype, torch.float32))
    if temperature != 1.0:
        logits_BTV = logits_BTV / temperature
    logp_BTV = torch.log_softmax(logits_BTV, dim=-1)
    logp_BT = F.pad(logp_BTV.gather(-1, input_ids[:, 1:, None]).squeeze(-1), (1, 0), value=0.0)
    if not return_entropy:
        return logp_BT
    with torch.no_grad():
        entropy_BT = F.pad(-(logp_BTV.exp() * logp_BTV).sum(-1), (1, 0), value=0.0)
    return logp_BT, entropy_BT


def _squared_norm(grads: tuple[Tensor | None, ...], device: torch.device) -> Tensor:
    """float64 ``sum_p ||grad_p||^2``; a parameter outside the graph (None) contributes 0."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        if g is not None:
            norm = torch.linalg.vector_norm(g, dtype=torch.promote_types(g.dtype, torch.float32))
            total = total + norm.double().square()
    return total


def _exact_grad_sq_norms(
    model: nn.Module, params: list[nn.Parameter], input_ids: Tensor, response_mask: Tensor,
    attention_mask: Tensor | None,
) -> Tensor:
    """The reference: one forward and one backward per row, each row alone with its own attention mask."""
    norms = []
    for b in range(input_ids.shape[0]):
        row = slice(b, b + 1)
        logp_1T = token_logprobs(model, input_ids[row], None if attention_mask is None else attention_mask[row])
        # where, not a product: log-probs at padded positions may be non-finite.
        score = torch.where(response_mask[row, 1:].bool(), logp_1T[:, 1:], torch.zeros_like(logp_1T[:, 1:])).sum()
        grads = torch.autograd.grad(score, params, allow_unused=True)
        norms.append(_squared_norm(grads, input_ids.device))
    return torch.stack(norms)


GradSqNormMethod = Callable[[nn.Module, list[nn.Parameter], Tensor, Tensor, Tensor | None], Tensor]


def _fast_grad_sq_norms(
    model: nn.Module, params: list[nn.Parameter], input_ids: Tensor, response_mask: Tensor,
    attention_mask: Tensor | None,
) -> Tensor:
    """One batched forward and one backward (ghost norms, see vcpo.variance.ghost_norms)."""
    from vcpo.variance.ghost_norms import ghost_grad_sq_norms  # imported here: ghost_norms imports this module

    return ghost_grad_sq_norms(model, params, input_ids, response_mask, attention_mask)


GRAD_SQ_NORM_METHODS: dict[str, GradSqNormMethod] = {"exact": _exact_grad_sq_norms, "fast": _fast_grad_sq_norms}


def trajectory_grad_sq_norms(
    model: nn.Module, input_ids: Tensor, response_mask: Tensor, attention_mask: Tensor | None = None,
    method: str = "exact",
) -> Tensor:
    """[B] float64 squared score-gradient norm of each trajectory:

        ``G_b = || grad_theta sum_t response_mask[b, t] * log p_theta(input_ids[b, t] | input_ids[b, <t]) ||^2``

    the squared norm of each trajectory's full score-function gradient, over all trainable
    parameters (``requires_grad``) of a Hugging Face causal LM, as OPOB needs it (VCPO, arXiv
    2602.17616, §8.3). Parameters are those of ``model.parameters()``, which lists a tied
    embedding once, so it counts once. ``response_mask[b, 0]`` is ignored: no logits predict
    position 0. ``attention_mask`` marks padding as Hugging Face models expect; positions it masks
    should also be 0 in ``response_mask``. The model's train/eval mode is used as it is (dropout in
    train mode makes the result random).

    ``method="exact"`` is the reference: one forward and backward per row (batch size 1, that row's
    attention mask). ``method="fast"`` gets every row's norm from one batched forward and one backward
    (ghost norms, ``vcpo.variance.ghost_norms``); it raises NotImplementedError naming a trainable
    parameter it cannot account for. The parameters' ``.grad`` are left as they were
    (``torch.autograd.grad``).
    """
    if method not in GRAD_SQ_NORM_METHODS:
        raise ValueError(
            f"unknown grad-norm method {method!r}; valid methods: {', '.join(sorted(GRAD_SQ_NORM_METHODS))}"
        )
    _check_token_tensors(input_ids, response_mask=response_mask, attention_mask=attention_mask)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("trajectory_grad_sq_norms: the model has no trainable parameters (requires_grad)")
    with torch.enable_grad():
        return GRAD_SQ_NORM_METHODS[method](model, params, input_ids, response_mask, attention_mask)
