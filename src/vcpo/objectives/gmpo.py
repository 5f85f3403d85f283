"""GMPO: the geometric mean of token ratios, clipped token by token in log space (arXiv 2507.20673)."""

from __future__ import annotations

import torch

from vcpo.objectives.aggregation import aggregate
from vcpo.objectives.common import clamped_exp, proximal_log_ratio
from vcpo.objectives.diagnostics import masked_fraction
from vcpo.objectives.registry import register
from vcpo.objectives.types import ObjectiveInputs, ObjectiveOutput


@register("gmpo")
def gmpo(
    inp: ObjectiveInputs,
    *,
    loss_agg: str = "seq-mean-token-mean",
    max_len: int | None = None,
    eps_low: float = 0.4,
    eps_high: float = 0.4,
) -> ObjectiveOutput:
    """Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv 2507.20673).

    With ``d = lp - olp`` (olp = old_logprobs, else behavior), each token's log-ratio is clipped
    pessimistically by the sign of its advantage, in log space:
    ``A > 0: d' = min(d, eps_high)``; ``A < 0: d' = max(d, -eps_low)``; ``A = 0: d' = d``.
    Then ``ratio_i = exp((1/L_i) sum_t m*d')`` and ``l_i = -A_i * ratio_i``, broadcast to the
    tokens of sequence i. This is PPO's ``min(rA, clip(r)A)`` applied to each factor of the
    geometric mean: for A > 0 only the upside is capped (at ratio e^eps_high), for A < 0 only the
    downside (at e^-eps_low). The gradient is ``-A_i * ratio_i / L_i`` on each unclipped token
    and 0 on a clipped one. Defaults: the paper's range (e^-0.4, e^0.4) and
    ``seq-mean-token-mean``, which is the paper's ``(1/G) sum_i l_i``. With per-token advantages
    each token uses its own sign and ``l_it = -A_it * ratio_i`` (equal to the paper when A is
    constant along a sequence).
    """
    d_BT = proximal_log_ratio(inp)
    adv_BT = inp.adv_BT
    clipped_d_BT = torch.where(
        adv_BT > 0, d_BT.clamp(max=eps_high), torch.where(adv_BT < 0, d_BT.clamp(min=-eps_low), d_BT)
    )
    log_ratio_B = clipped_d_BT.sum(dim=1) / inp.lengths.clamp(min=1.0)
    ratio_B = clamped_exp(log_ratio_B)
    loss_BT = -adv_BT * ratio_B.unsqueeze(1)
    loss = aggregate(loss_BT, inp.mask, loss_agg, max_len)

    d = d_BT.detach()
    is_clipped_BT = ((adv_BT > 0) & (d > eps_high)) | ((adv_BT < 0) & (d < -eps_low))
    nonempty_B = inp.mask.bool().any(dim=1)
    ratio_mean = float(ratio_B.detach()[nonempty_B].double().mean()) if bool(nonempty_B.any()) else 0.0
    metrics = {"clip/frac": masked_fraction(is_clipped_BT, inp.mask), "gmpo/seq_ratio_mean": ratio_mean}
    return ObjectiveOutput(loss, metrics)
