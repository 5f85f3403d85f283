"""TOPR: tapered off-policy REINFORCE, plain on positive rewards, ratio-tapered on negative ones."""

from __future__ import annotations

import torch

from vcpo.objectives.aggregation import aggregate
from vcpo.objectives.common import clamped_exp
from vcpo.objectives.diagnostics import masked_fraction, masked_mean
from vcpo.objectives.registry import register
from vcpo.objectives.types import ObjectiveInputs, ObjectiveOutput


@register("topr")
def topr(
    inp: ObjectiveInputs,
    *,
    loss_agg: str = "seq-mean-token-sum",
    max_len: int | None = None,
    level: str = "sequence",
) -> ObjectiveOutput:
    """``l[i,t] = -sg(w[i,t]) * R[i,t] * lp[i,t]``, with w = 1 where R >= 0 and a taper where R < 0.

    ``R`` is ``rewards`` ([B], broadcast to the tokens); when rewards are None it is
    ``advantages`` ([B] or [B, T]), whose sign is then read per token.
    - ``level="sequence"`` (the paper): ``w_i = clip(W_i, 0, 1)`` for R_i < 0, with the sequence
      ratio ``W_i = exp(logW_i)``, ``logW_i = sum_t m * (lp - blp)`` clamped to [-20, 20].
    - ``level="token"``: ``w[i,t] = clip(r[i,t], 0, 1)``, ``r = exp(lp - blp)`` per token.

    Positive rewards get plain REINFORCE (no importance weight), which is what keeps off-policy
    learning fast; negative ones are tapered so that pushing an already unlikely bad answer
    further down stops when pi << mu, which keeps the objective bounded. R == 0 counts as
    positive, as in the paper (its sets are R >= 0 and R < 0); it contributes zero either way.
    Ratios are against ``behavior_logprobs`` (``old_logprobs`` is ignored). With ``lp == blp``
    every taper is 1 and the gradient is REINFORCE's with R as the advantage.

    Le Roux, Bellemare et al. 2025, "Tapered off-policy REINFORCE" (arXiv 2503.14286). Default
    level sequence and aggregation seq-mean-token-sum: the paper's gradient is
    ``R * grad log pi(y)`` with ``log pi(y) = sum_t lp``, averaged over trajectories.
    Metrics: ``topr/pos_frac`` is the fraction of non-empty sequences with R >= 0 (of counted
    tokens when R is per token); ``topr/neg_weight_mean`` is the mean taper over counted tokens
    with R < 0 (0 when there are none).
    """
    signal = inp.rewards if inp.rewards is not None else inp.advantages
    signal = signal.detach().to(inp.logprobs.dtype)
    reward_BT = signal.unsqueeze(1).expand_as(inp.logprobs) if signal.dim() == 1 else signal
    negative_BT = reward_BT < 0

    if level == "sequence":
        log_ratio_BT = inp.seq_log_weights.unsqueeze(1).expand_as(inp.logprobs)
    else:
        log_ratio_BT = inp.behavior_log_ratio
    taper_BT = clamped_exp(log_ratio_BT).clamp(max=1.0)
    weight_BT = torch.where(negative_BT, taper_BT, torch.ones_like(taper_BT))
    loss_BT = -weight_BT * reward_BT * inp.logprobs

    mask = inp.mask.bool()
    if signal.dim() == 1:
        nonempty_B = inp.lengths > 0
        n_rows = int(nonempty_B.sum())
        pos_frac = float((signal[nonempty_B] >= 0).sum()) / n_rows if n_rows else 0.0
    else:
        pos_frac = masked_fraction(~negative_BT, mask)
    metrics = {
        "topr/pos_frac": pos_frac,
        "topr/neg_weight_mean": masked_mean(weight_BT, negative_BT & mask),
    }
    return ObjectiveOutput(aggregate(loss_BT, inp.mask, loss_agg, max_len), metrics)
