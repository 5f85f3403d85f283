"""The VCPO loss: sequence-level truncated importance sampling in REINFORCE form."""

from __future__ import annotations

import math

import torch

from vcpo.objectives.aggregation import aggregate
from vcpo.objectives.common import clamped_exp
from vcpo.objectives.registry import register
from vcpo.objectives.types import ObjectiveInputs, ObjectiveOutput
from vcpo.variance import ess_ratio


@register("vcpo")
def vcpo(
    inp: ObjectiveInputs,
    *,
    loss_agg: str = "seq-mean-token-mean",
    max_len: int | None = None,
    cap: float = 8.0,
) -> ObjectiveOutput:
    """``L = -(1/B) sum_i min(W_i, cap) * A_i * (1/L_i) sum_t lp[i,t]`` (VCPO, arXiv 2602.17616, §8.1).

    Per token ``l[i,t] = -sg(min(W_i, cap)) * A[i,t] * lp[i,t]`` with ``W_i = exp(logW_i)``,
    ``logW_i = sum_t m * (lp - blp)`` the true sequence log-weight against the behavior policy
    (clamped to [-20, 20] before exp; ``old_logprobs`` is not used), aggregated by
    ``seq-mean-token-mean`` by default. No PPO clip and no KL term: the paper takes one optimizer
    step per batch. cap = 8 as published.

    The other two parts of VCPO are not in this loss: the ESS-scaled learning rate
    (``vcpo.variance.ess_lr_scale``, applied by the trainer to the step size with the UNCLIPPED
    weights) and the off-policy optimal baseline OPOB (``vcpo.variance.opob_advantages``, which
    produces the advantages this loss consumes).

    Metrics, over sequences with at least one counted token: ``clip/frac`` (fraction whose weight
    was capped, W > cap), ``ess/ratio_clipped`` (ESS / B of the capped weights, from the unclamped
    log-weights capped at log(cap); absent when no sequence counts), ``vcpo/weight_mean`` and
    ``vcpo/weight_max`` (of the weights the loss applies, min(W, cap)). The unclipped ``ess/ratio``
    is added by the registry.
    """
    logw_B = inp.seq_log_weights
    log_cap = math.log(cap)
    # Capping in log space equals min(exp(clamped logW), cap) and never forms exp of a large number.
    weight_B = clamped_exp(torch.clamp(logw_B, max=log_cap))
    loss_BT = -weight_B.unsqueeze(1) * inp.adv_BT * inp.logprobs
    loss = aggregate(loss_BT, inp.mask, loss_agg, max_len)
    nonempty_B = inp.lengths > 0
    if not bool(nonempty_B.any()):
        # Like the registry's ess/ratio, the ESS of an empty batch is left out rather than invented.
        return ObjectiveOutput(loss, {"clip/frac": 0.0, "vcpo/weight_mean": 0.0, "vcpo/weight_max": 0.0})
    logw = logw_B[nonempty_B]
    w = weight_B[nonempty_B].double()
    metrics = {
        "clip/frac": float((logw > log_cap).double().mean()),
        "ess/ratio_clipped": float(ess_ratio(torch.clamp(logw, max=log_cap))),
        "vcpo/weight_mean": float(w.mean()),
        "vcpo/weight_max": float(w.max()),
    }
    return ObjectiveOutput(loss, metrics)
