"""The per-trajectory squared score-gradient norms ``G_i`` of a Hugging Face causal LM that OPOB weights by
(VCPO, arXiv 2602.17616, §8.3): the exact reference, the dispatch to the fast method, and the forward-only logit
proxy."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from vcpo.variance.logprobs import check_token_tensors, token_logprobs


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
    check_token_tensors(input_ids, response_mask=response_mask, attention_mask=attention_mask)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("trajectory_grad_sq_norms: the model has no trainable parameters (requires_grad)")
    with torch.enable_grad():
        return GRAD_SQ_NORM_METHODS[method](model, params, input_ids, response_mask, attention_mask)


def logit_proxy_grad_sq_norms(
    logprobs: Tensor, collision: Tensor, response_mask: Tensor, temperature: float = 1.0
) -> Tensor:
    """[B] float64 squared norm of the gradient of each sequence's log-prob with respect to the LOGITS only:

        ``P_b = sum_{t >= 1} response_mask[b, t] * (1 - 2 pi_t(y_t) + sum_v pi_t(v)^2) / T^2``

    For one token, ``d log softmax(z / T)_y / dz = (onehot(y) - pi) / T``, whose squared norm is
    ``((1 - pi_y)^2 + sum_{v != y} pi_v^2) / T^2``; the gradients of different positions' logits are different
    coordinates, so the sequence's squared norm is the sum over its tokens. It is the proxy of verl's optimal
    token baseline (arXiv 2602.07078): it ignores everything below the logits, so it ranks rows by how much
    their tokens could still move rather than measuring ``G_i`` (``trajectory_grad_sq_norms``). ``logprobs`` and
    ``collision`` are ``token_logprobs(..., return_collision=True)``'s first and third outputs at ``temperature``
    (``pi_t(y_t) = exp(logprobs)``); nothing here runs the model or a backward. ``response_mask[:, 0]`` is
    ignored (no logits predict position 0) and masked positions contribute 0 even if non-finite.
    """
    check_token_tensors(logprobs, collision=collision, response_mask=response_mask)
    if not temperature > 0:
        raise ValueError(f"logit_proxy_grad_sq_norms: temperature must be > 0, got {temperature!r}")
    lp_BT, collision_BT = logprobs.detach().double(), collision.detach().double()
    counted_BT = response_mask.bool().clone()
    counted_BT[:, 0] = False
    per_token_BT = (1 - 2 * lp_BT.exp() + collision_BT) / temperature**2
    return torch.where(counted_BT, per_token_BT, torch.zeros_like(per_token_BT)).sum(1)
