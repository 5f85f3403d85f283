"""Importance weights and effective sample size, in log space (VCPO, arXiv 2602.17616, §8.2)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def sequence_log_weights(logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[B] ``logW_i = sum_t m[i,t] * (lp[i,t] - blp[i,t])``, detached and unclamped.

    A true product of token ratios (no length normalisation); masked positions never contribute,
    even when they hold inf or nan.
    """
    if logprobs.shape != behavior_logprobs.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, behavior_logprobs {tuple(behavior_logprobs.shape)} and "
            f"mask {tuple(mask.shape)} must share one [B, T] shape"
        )
    d = logprobs.detach() - behavior_logprobs.detach()
    return torch.where(mask.bool(), d, torch.zeros_like(d)).sum(dim=1)


def ess(logw: Tensor) -> Tensor:
    """Effective sample size ``(sum W)^2 / sum W^2`` of weights ``W = exp(logw)``, in [1, B].

    Computed in log space with ``u = logw - max(logw)``: ``ESS = (sum e^u)^2 / sum e^{2u}``, so it
    is finite for any finite log-weights (the largest term is exactly 1).
    """
    if logw.dim() != 1 or logw.numel() == 0:
        raise ValueError(f"ess expects a non-empty 1-D tensor of log-weights, got shape {tuple(logw.shape)}")
    u = logw.detach().double()
    u = u - u.max()
    return (torch.exp(torch.logsumexp(u, 0) * 2 - torch.logsumexp(2 * u, 0))).to(logw.dtype)


def ess_ratio(logw: Tensor) -> Tensor:
    """``rho = ESS / B`` in [1/B, 1]: 1 for uniform weights, near 1/B when one weight dominates."""
    return ess(logw) / logw.numel()


def ess_lr_scale(rho: float, reference: float = 1.0, rule: str = "sqrt") -> float:
    """VCPO's learning-rate multiplier from the ESS ratio ``rho``.

    ``sqrt``: ``sqrt(min(1, rho / reference))``; ``linear``: ``min(1, rho / reference)``.
    ``reference`` is 1.0 for single-turn math and 0.55 for multi-turn tool use in the paper.
    The trainer multiplies the step size (not the gradient: Adam would undo that) by it.
    """
    rho = float(rho)
    if not math.isfinite(rho) or rho < 0:
        raise ValueError(f"ess_lr_scale: rho must be a finite non-negative number, got {rho!r}")
    if not (reference > 0 and math.isfinite(reference)):
        raise ValueError(f"ess_lr_scale: reference must be > 0, got {reference!r}")
    x = min(1.0, rho / reference)
    if rule == "sqrt":
        return math.sqrt(x)
    if rule == "linear":
        return x
    raise ValueError(f"ess_lr_scale: unknown rule {rule!r}; valid rules: 'sqrt', 'linear'")
