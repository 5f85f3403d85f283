"""A user's own objective, outside vcpo: tempered sequence-level importance sampling.

    l[i,t] = -sg(min(W_i, cap) ** power) * A_i * lp[i,t],   W_i = exp(sum_t m * (lp - blp))

``power`` = 0 is plain REINFORCE, 1 is sequence-level truncated IS (vcpo's own ``vcpo`` objective); in between
the weight is tempered, trading bias for variance. Named in the config by its import path (config.yaml here):

    objective:
      name: tempered_is:tempered_tis
      kwargs: {power: 0.5, cap: 4.0}
"""

from __future__ import annotations

import math

import torch

from vcpo.objective_specs import Param
from vcpo.objectives import ObjectiveInputs, ObjectiveOutput, aggregate, register


@register("tempered_tis", params={"cap": Param(float, 4.0, low=1.0), "power": Param(float, 0.5, low=0.0, high=1.0)})
def tempered_tis(inp: ObjectiveInputs, *, loss_agg: str = "seq-mean-token-mean", max_len: int | None = None,
                 cap: float = 4.0, power: float = 0.5) -> ObjectiveOutput:
    """Sequence weight ``min(W, cap) ** power``, formed in log space so that any log-weight stays finite."""
    logw_B = inp.seq_log_weights  # detached: the weight is a constant of the gradient
    weight_B = torch.exp(power * torch.clamp(logw_B, max=math.log(cap)))
    loss_BT = -weight_B.unsqueeze(1) * inp.adv_BT * inp.logprobs
    counted_B = inp.lengths > 0
    metrics = {}
    if bool(counted_B.any()):
        metrics["tempered/weight_mean"] = float(weight_B[counted_B].mean())
        metrics["clip/frac"] = float((logw_B[counted_B] > math.log(cap)).double().mean())
    return ObjectiveOutput(aggregate(loss_BT, inp.mask, loss_agg, max_len), metrics)
