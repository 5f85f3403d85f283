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
    weight: str = "ratio",
) -> ObjectiveOutput:
    """``l[i,t] = -sg(w) * A * lp`` with ``w = v * 1[low <= r <= high]``, r against the behavior policy,
    ``v = r`` (``weight="ratio"``, ALGORITHMS.md §3) or ``v = 1`` (``weight="unit"``, rejection only).

    - ``level="token"``: ``r[i,t] = exp(lp - blp)`` per token.
    - ``level="sequence"``: ``r_i = exp(logW_i)``, ``logW_i = sum_t m * (lp - blp)``, broadcast.
    - ``level="geometric"``: ``r_i = exp(logW_i / L_i)``, the per-token geometric mean, broadcast.

    The bound test runs in log space on the unclamped log-ratio (so a log-ratio of 1000 is
    rejected, not clamped into range); the kept weight is ``exp`` of the log-ratio clamped to
    [-20, 20]. Masked tokens contribute zero but stay in the denominator (the pre-mask token
    count, ALGORITHMS.md §1). ``old_logprobs`` is ignored: the weight corrects the sampling
    distribution. With ``lp == blp`` every ratio is 1, inside any valid bounds, so the gradient
    is REINFORCE's. Bounds must satisfy 0 <= low <= 1 <= high so that on-policy data are kept.

    What follows which peer (verl at commit b178a3c, ``verl/trainer/config/algorithm.py`` and
    ``verl/trainer/ppo/rollout_corr_helper.py``; their REINFORCE form is ``loss_type="reinforce"``
    in bypass mode, whose loss is ours):
    - Liu, Li et al. 2025, "When speed kills stability" (blog, richardli.xyz/rl-collapse)
      introduces sequence MIS with an upper bound only: ``level="sequence", low=0, high=2``.
    - The bounds used when ``low`` / ``high`` are None are verl's preset thresholds: token and
      sequence [0.5, 2.0] (``"0.5_2.0"``, upper 2 and lower its reciprocal), geometric
      [0.999, 1.001] (``"0.999_1.001"``).
    - ``weight="ratio"`` at token or sequence level equals verl's truncated IS weight
      ``min(r, high)`` (``rollout_is`` at the same level, threshold = high) on the rows its k1
      rejection (``token_k1`` / ``seq_sum_k1``, ``"low_high"``) keeps, since a kept r is <= high.
    - ``weight="unit"`` with ``level="geometric"`` is verl's ``bypass_pg_geo_rs`` preset:
      ``rollout_is=None`` (kept rows weigh 1) and ``rollout_rs="seq_mean_k1"``.
      ``weight="ratio"`` at the geometric level (kept rows weighed by exp(logW/L)) follows
      ALGORITHMS.md §3 and matches no verl preset.
    - verl's k1 rejection tests ``-log r`` against ``[log low, log high]``, i.e. keeps r in
      ``[1/high, 1/low]``; that is our ``[low, high]`` when ``low = 1/high`` (0.5 and 2), but for
      0.999 / 1.001 the two intervals differ by about 1e-6 at each end: pass ``low=1/1.001,
      high=1/0.999`` to reproduce verl's exactly. verl also clamps each token log-ratio to
      [-20, 20] before the test, which matters only for log-ratios beyond 20.
    Default level token, ``weight="ratio"``, token-mean aggregation.

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
    kept_value_BT = clamped_exp(log_ratio_BT) if weight == "ratio" else torch.ones_like(log_ratio_BT)
    weight_BT = torch.where(keep_BT, kept_value_BT, torch.zeros_like(log_ratio_BT))
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
