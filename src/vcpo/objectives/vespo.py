"""VESPO: a smooth, sign-dependent kernel of the sequence importance weight in REINFORCE form."""

from __future__ import annotations

import torch
from torch import Tensor

from vcpo.objectives.aggregation import aggregate
from vcpo.objectives.common import clamped_exp
from vcpo.objectives.registry import register
from vcpo.objectives.types import LOG_RATIO_CLAMP, ObjectiveInputs, ObjectiveOutput


def vespo_kernel(logw: Tensor, k: Tensor | float, lam: Tensor | float) -> Tensor:
    """``phi(W) = W^k * exp(lam * (1 - W))`` evaluated in log space from ``logW``.

    ``log phi = k * logW + lam * (1 - W)`` with ``logW`` clamped to [-20, 20] first, so
    ``phi(1) = 1`` and, for k, lam > 0, the single maximum sits at ``W = k / lam`` (where
    ``d log phi / dW = k/W - lam = 0``). VESPO, arXiv 2602.10693. A NaN or infinite result
    (only possible from non-finite inputs or hyperparameters) becomes 0, so that such a
    sequence carries no weight rather than poisoning the batch.
    """
    logw_c = logw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    phi = torch.exp(k * logw_c + lam * (1.0 - clamped_exp(logw_c)))
    return torch.where(torch.isfinite(phi), phi, torch.zeros_like(phi))


@register("vespo")
def vespo(
    inp: ObjectiveInputs,
    *,
    loss_agg: str = "token-mean",
    max_len: int | None = None,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> ObjectiveOutput:
    """``l[i,t] = -sg(phi(W_i)) * A[i,t] * lp[i,t]`` with the kernel of :func:`vespo_kernel`.

    ``W_i = exp(logW_i)``, ``logW_i = sum_t m * (lp - blp)`` the true sequence log-weight against
    the behavior policy (no length normalisation; ``old_logprobs`` is not used). The kernel
    parameters follow the sign of the advantage: ``(k_pos, lambda_pos) = (2, 3)`` where A >= 0
    (zero counts as positive), ``(k_neg, lambda_neg) = (3, 2)`` where A < 0. VESPO, arXiv
    2602.10693; the authors aggregate by token-mean, the default here.

    Choice: with per-token advantages ``[B, T]`` the sign (and so the kernel) is taken per token;
    with ``[B]`` advantages this is the same as per sequence.

    Metrics (only for the signs present in the batch, else 0): ``vespo/phi_mean_pos``,
    ``vespo/phi_mean_neg``, ``vespo/phi_max_pos``, ``vespo/phi_max_neg``, and the unclamped
    ``vespo/logw_mean_pos``, ``vespo/logw_mean_neg``. Means are over counted tokens, i.e. a
    sequence weighs by its length, as it does in the token-mean loss.
    """
    adv_BT = inp.adv_BT
    pos_BT = adv_BT >= 0
    logw_B = inp.seq_log_weights
    logw_BT = logw_B.unsqueeze(1).expand_as(adv_BT)
    k_BT = torch.where(pos_BT, k_pos, k_neg).to(adv_BT.dtype)
    lam_BT = torch.where(pos_BT, lambda_pos, lambda_neg).to(adv_BT.dtype)
    phi_BT = vespo_kernel(logw_BT, k_BT, lam_BT)
    loss_BT = -phi_BT * adv_BT * inp.logprobs
    loss = aggregate(loss_BT, inp.mask, loss_agg, max_len)
    return ObjectiveOutput(loss, _sign_metrics(phi_BT, logw_BT, pos_BT, inp.mask.bool()))


def _sign_metrics(phi_BT: Tensor, logw_BT: Tensor, pos_BT: Tensor, mask_BT: Tensor) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for name, sel_BT in (("pos", pos_BT & mask_BT), ("neg", ~pos_BT & mask_BT)):
        phi = phi_BT[sel_BT].double()
        logw = logw_BT[sel_BT].double()
        present = phi.numel() > 0
        metrics[f"vespo/phi_mean_{name}"] = float(phi.mean()) if present else 0.0
        metrics[f"vespo/phi_max_{name}"] = float(phi.max()) if present else 0.0
        metrics[f"vespo/logw_mean_{name}"] = float(logw.mean()) if present else 0.0
    return metrics
