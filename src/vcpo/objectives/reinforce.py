"""REINFORCE / GPG: the plain score-function policy gradient, no importance correction."""

from __future__ import annotations

from vcpo.objectives.aggregation import aggregate
from vcpo.objectives.registry import register
from vcpo.objectives.types import ObjectiveInputs, ObjectiveOutput


@register("reinforce")
def reinforce(inp: ObjectiveInputs, *, loss_agg: str = "token-mean", max_len: int | None = None) -> ObjectiveOutput:
    """``l[i,t] = -A[i,t] * lp[i,t]``; the gradient is ``-A * grad log pi``.

    Williams (1992), "Simple statistical gradient-following algorithms"; GPG (Chu et al. 2025,
    arXiv 2504.02546) as the group-relative form. Ignores the behavior policy entirely, so it is
    biased whenever the data are stale; it is the on-policy reference the IS objectives reduce to.
    Default aggregation: token-mean.
    """
    loss_BT = -inp.adv_BT * inp.logprobs
    return ObjectiveOutput(aggregate(loss_BT, inp.mask, loss_agg, max_len))
