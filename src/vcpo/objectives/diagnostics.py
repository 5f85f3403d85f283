"""Diagnostics shared by every objective: how far the behavior policy is from the current one.

All quantities are detached and computed from unclamped log-ratios (ALGORITHMS.md §10). Keys:
``is/token_ratio_{p50,p90,p99,max}``, ``is/logw_{p50,p90,p99,max}``, ``kl/k1``, ``kl/k3``,
``ess/ratio``. Token ratios are reported as exp of the log-ratio quantile, with the exponent
capped at 50 so that JSON stays finite; the log-space ``is/logw_*`` keys are never capped.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vcpo.objectives.types import ObjectiveInputs
from vcpo.variance.ess import ess_ratio

QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
_RATIO_EXP_CAP = 50.0


def quantile_metrics(prefix: str, values: Tensor, exp: bool = False) -> dict[str, float]:
    """p50/p90/p99/max of a 1-D tensor under ``prefix``; exp'ed (capped) when ``exp`` is set."""
    if values.numel() == 0:
        return {}
    v = values.detach().double().flatten()
    qs = torch.quantile(v, torch.tensor([q for _, q in QUANTILES], dtype=v.dtype, device=v.device))
    out = {f"{prefix}_{name}": float(q) for (name, _), q in zip(QUANTILES, qs, strict=True)}
    out[f"{prefix}_max"] = float(v.max())
    if exp:
        out = {k: math.exp(min(x, _RATIO_EXP_CAP)) for k, x in out.items()}
    return out


def masked_fraction(cond_BT: Tensor, mask_BT: Tensor) -> float:
    """Fraction of counted tokens (mask) where ``cond`` holds; 0 when nothing is counted."""
    m = mask_BT.bool()
    n = int(m.sum())
    return float((cond_BT.bool() & m).sum()) / n if n else 0.0


def masked_mean(x_BT: Tensor, mask_BT: Tensor) -> float:
    """Mean of ``x`` over counted tokens; 0 when nothing is counted."""
    m = mask_BT.bool()
    n = int(m.sum())
    return float(x_BT.detach().double()[m].sum()) / n if n else 0.0


def behavior_metrics(inp: ObjectiveInputs) -> dict[str, float]:
    """Ratio tails, KL(mu||pi) estimators and the ESS ratio of the batch, against mu.

    With samples from mu and d = log pi - log mu: k1 = -d (unbiased, can be negative),
    k3 = e^d - 1 - d (unbiased, non-negative; d clamped at 50 before exp to stay finite).
    The ESS ratio uses the unclipped sequence weights of the rows with at least one token.
    """
    m = inp.mask.bool()
    d = inp.behavior_log_ratio.double()[m]
    metrics: dict[str, float] = {}
    if d.numel():
        metrics |= quantile_metrics("is/token_ratio", d, exp=True)
        metrics["kl/k1"] = float((-d).mean())
        metrics["kl/k3"] = float((torch.exp(d.clamp(max=_RATIO_EXP_CAP)) - 1 - d).mean())
    nonempty = inp.lengths > 0
    logw = inp.seq_log_weights[nonempty]
    if logw.numel():
        metrics |= quantile_metrics("is/logw", logw)
        metrics["ess/ratio"] = float(ess_ratio(logw))
    return metrics
