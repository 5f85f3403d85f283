"""Masked importance sampling (MIS): keep the behavior IS weight inside [low, high], drop the rest."""

from __future__ import annotations

import math

import torch

from vcpo.objectives.aggregation import aggregate
from vcpo.objectives.common import clamped_exp
from vcpo.objectives.diagnostics import masked_fraction, masked_mean
from vcpo.objectives.registry import register
from vcpo.objectives.types import ObjectiveInputs, ObjectiveOutput

MIS_DEFAULT_BOUNDS = {"token": (0.5, 2.0), "sequence": (0.5, 2.0), "geometric": (0.999, 1.001)}
"""Published bounds per level, used when ``low`` / ``high`` are left at None (see ``mis``)."""


@register("mis")
def mis(
    inp: ObjectiveInputs,
    *,
    loss_agg: str = "token-mean",
    max_len: int | None = None,
    level: str = "token",
    low: float | None = None,
    high: float | None = None,
) -> ObjectiveOutput:
    """``l[i,t] = -sg(w) * A * lp`` with ``w = r * 1[low <= r <= high]``, r against the behavior policy.

    - ``level="token"``: ``r[i,t] = exp(lp - blp)`` per token.
    - ``level="sequence"``: ``r_i = exp(logW_i)``, ``logW_i = sum_t m * (lp - blp)``, broadcast.
    - ``level="geometric"``: ``r_i = exp(logW_i / L_i)``, the per-token geometric mean, broadcast.

    The bound test runs in log space on the unclamped log-ratio (so a log-ratio of 1000 is
    rejected, not clamped into range); the kept weight is ``exp`` of the log-ratio clamped to
    [-20, 20]. Masked tokens contribute zero but stay in the denominator (the pre-mask token
    count, ALGORITHMS.md §1). ``old_logprobs`` is ignored: the weight corrects the sampling
    distribution. With ``lp == blp`` every ratio is 1, inside any valid bounds, so the gradient
    is REINFORCE's.

    Liu, Li et al. 2025, "When speed kills stability: demystifying RL collapse from the
    training-inference mismatch" (blog, richardli.xyz/rl-collapse), which introduces MIS
    (sequence level, upper bound only) and the geometric-mean rejection. Defaults, when ``low``
    / ``high`` are None, follow verl's rollout-correction presets by the same authors: token and
    sequence [0.5, 2.0] (upper 2, lower its reciprocal), geometric [0.999, 1.001]. Pass
    ``low=0`` for the blog's upper-only sequence MIS. Bounds must satisfy 0 <= low <= 1 <= high
    so that on-policy data are always kept. Default level token, token-mean aggregation.
    Metrics: ``mask/frac`` (fraction of counted tokens dropped), ``mis/weight_mean`` (mean of w
    over counted tokens, dropped ones as 0).
    """
    default_low, default_high = MIS_DEFAULT_BOUNDS[level]
    low = default_low if low is None else low
    high = default_high if high is None else high

    mask = inp.mask
    log_ratio_BT = _level_log_ratio(inp, level)
    log_low = math.log(low) if low > 0 else -math.inf
    keep_BT = (log_ratio_BT >= log_low) & (log_ratio_BT <= math.log(high))
    weight_BT = torch.where(keep_BT, clamped_exp(log_ratio_BT), torch.zeros_like(log_ratio_BT))
    loss_BT = -weight_BT * inp.adv_BT * inp.logprobs
    metrics = {
        "mask/frac": masked_fraction(~keep_BT, mask),
        "mis/weight_mean": masked_mean(weight_BT, mask),
    }
    return ObjectiveOutput(aggregate(loss_BT, mask, loss_agg, max_len), metrics)


def _level_log_ratio(inp: ObjectiveInputs, level: str) -> torch.Tensor:
    """[B, T] detached, unclamped log of the MIS ratio at ``level``, broadcast to the tokens."""
    if level == "token":
        return inp.behavior_log_ratio
    logw_B = inp.seq_log_weights
    if level == "geometric":
        # An empty row has logW = 0; dividing by max(L, 1) keeps it at 0 instead of 0/0.
        logw_B = logw_B / inp.lengths.clamp(min=1.0)
    return logw_B.unsqueeze(1).expand_as(inp.logprobs)
