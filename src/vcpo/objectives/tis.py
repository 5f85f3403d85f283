"""Truncated importance sampling (TIS) against the behavior policy, in REINFORCE form."""

from __future__ import annotations

import math

import torch

from vcpo.objectives.aggregation import aggregate
from vcpo.objectives.common import clamped_exp
from vcpo.objectives.diagnostics import masked_fraction, masked_mean
from vcpo.objectives.registry import register
from vcpo.objectives.types import ObjectiveInputs, ObjectiveOutput


@register("tis")
def tis(
    inp: ObjectiveInputs,
    *,
    loss_agg: str = "token-mean",
    max_len: int | None = None,
    level: str = "token",
    cap: float = 2.0,
) -> ObjectiveOutput:
    """``l[i,t] = -sg(w) * A * lp`` with a truncated behavior importance weight ``w``.

    - ``level="token"``: ``w[i,t] = min(r[i,t], cap)``, ``r = exp(lp - blp)``.
    - ``level="sequence"``: ``w_i = min(exp(logW_i), cap)`` broadcast to the tokens of row i,
      ``logW_i = sum_t m * (lp - blp)`` (a true product, no length normalisation).

    Both log-ratios are clamped to [-20, 20] before ``exp``. The weight is always taken against
    ``behavior_logprobs`` (``old_logprobs`` is ignored): TIS corrects the sampling distribution,
    there is no proximal policy in REINFORCE form. With ``cap >= 1`` and ``lp == blp`` every
    weight is 1 and the gradient is REINFORCE's.

    Truncated IS: Ionides (2008), J. Comput. Graph. Stat. 17(2); as V-trace's truncation in
    IMPALA (Espeholt et al. 2018, arXiv 1802.01561). Token TIS with cap 2 for the
    training/inference mismatch: Yao et al. 2025, "Your efficient RL framework secretly brings
    you off-policy RL training" (blog, fengyao.notion.site/off-policy-rl), also verl's default
    threshold. Sequence TIS: Liu, Li et al. 2025, "When speed kills stability" (blog, cap 2) and
    VCPO (arXiv 2602.17616, cap 8; see the ``vcpo`` objective for its exact loss).

    Defaults: token level, cap 2.0, token-mean aggregation. Metrics: ``clip/frac`` is the
    fraction of counted tokens (token level) or of non-empty sequences (sequence level) whose
    weight was truncated; ``tis/weight_mean`` is the mean weight over the same units.
    """
    log_cap = math.log(cap)
    mask = inp.mask
    if level == "token":
        log_ratio_BT = inp.behavior_log_ratio
        weight_BT = clamped_exp(log_ratio_BT).clamp(max=cap)
        metrics = {
            "clip/frac": masked_fraction(log_ratio_BT > log_cap, mask),
            "tis/weight_mean": masked_mean(weight_BT, mask),
        }
    else:
        logw_B = inp.seq_log_weights
        weight_B = clamped_exp(logw_B).clamp(max=cap)
        weight_BT = weight_B.unsqueeze(1).expand_as(inp.logprobs)
        # Rows without counted tokens carry no sequence and must not dilute the fractions.
        nonempty_B = inp.lengths > 0
        metrics = {
            "clip/frac": _row_mean((logw_B > log_cap).to(weight_B.dtype), nonempty_B),
            "tis/weight_mean": _row_mean(weight_B, nonempty_B),
        }
    loss_BT = -weight_BT.detach() * inp.adv_BT * inp.logprobs
    return ObjectiveOutput(aggregate(loss_BT, mask, loss_agg, max_len), metrics)


def _row_mean(x_B: torch.Tensor, rows_B: torch.Tensor) -> float:
    """Mean of ``x`` over the selected rows; 0 when none is selected."""
    n = int(rows_B.sum())
    return float(x_B.detach().double()[rows_B].sum()) / n if n else 0.0
