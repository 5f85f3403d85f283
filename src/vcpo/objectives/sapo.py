"""SAPO: a smooth sigmoid gate on the token ratio in place of PPO's hard clip (arXiv 2511.20347)."""

from __future__ import annotations

import torch

from vcpo.objectives.aggregation import aggregate
from vcpo.objectives.common import clamped_exp, proximal_log_ratio
from vcpo.objectives.diagnostics import masked_mean
from vcpo.objectives.registry import register
from vcpo.objectives.types import ObjectiveInputs, ObjectiveOutput


@register("sapo")
def sapo(
    inp: ObjectiveInputs,
    *,
    loss_agg: str = "seq-mean-token-mean",
    max_len: int | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> ObjectiveOutput:
    """Soft Adaptive Policy Optimization (Gao et al., Qwen team 2025, arXiv 2511.20347).

    Token ratio ``r = exp(lp - olp)`` (olp = old_logprobs, else behavior), temperature
    ``tau = tau_pos if A > 0 else tau_neg``, gate ``g(r) = sigmoid(tau*(r-1)) * 4/tau`` and
    ``l = -g(r) * A``. Since ``dg/dr = 4*s*(1-s)`` with ``s = sigmoid(tau*(r-1))``, the gradient
    is ``-A * 4s(1-s) * r * grad lp``: exactly the on-policy ``-A * grad lp`` at r = 1, decaying
    smoothly (never to a hard zero) as r leaves 1, faster for the larger tau of negative tokens.
    Defaults: the paper's tau_pos = 1.0, tau_neg = 1.05 and ``seq-mean-token-mean``, the
    ``(1/G) sum_i (1/|y_i|) sum_t`` of its objective.
    Metrics: ``sapo/gate_mean`` (mean g) and ``sapo/gate_grad_mean`` (mean 4s(1-s), the factor
    that multiplies the importance-weighted gradient; 1 on-policy).
    """
    ratio_BT = clamped_exp(proximal_log_ratio(inp))
    adv_BT = inp.adv_BT
    tau_BT = torch.where(adv_BT > 0, adv_BT.new_tensor(tau_pos), adv_BT.new_tensor(tau_neg))
    sig_BT = torch.sigmoid(tau_BT * (ratio_BT - 1.0))
    gate_BT = sig_BT * (4.0 / tau_BT)
    loss_BT = -gate_BT * adv_BT
    loss = aggregate(loss_BT, inp.mask, loss_agg, max_len)
    s = sig_BT.detach()
    metrics = {
        "sapo/gate_mean": masked_mean(gate_BT, inp.mask),
        "sapo/gate_grad_mean": masked_mean(4.0 * s * (1.0 - s), inp.mask),
    }
    return ObjectiveOutput(loss, metrics)
