"""CISPO: REINFORCE weighted by a clipped, detached token ratio (MiniMax-M1, arXiv 2506.13585)."""

from __future__ import annotations

from vcpo.objectives.aggregation import aggregate
from vcpo.objectives.common import clamped_exp, proximal_log_ratio
from vcpo.objectives.diagnostics import masked_fraction
from vcpo.objectives.registry import register
from vcpo.objectives.types import ObjectiveInputs, ObjectiveOutput


@register("cispo")
def cispo(
    inp: ObjectiveInputs,
    *,
    loss_agg: str = "token-mean",
    max_len: int | None = None,
    eps_low: float = 1.0,
    eps_high: float = 3.0,
) -> ObjectiveOutput:
    """Clipped IS-weight Policy Optimization (MiniMax et al. 2025, arXiv 2506.13585).

    ``l = -sg(clip(r, 1-eps_low, 1+eps_high)) * A * lp`` with ``r = exp(lp - olp)`` (olp =
    old_logprobs, else behavior). The gradient is ``-clip(r) * A * grad lp``: every token keeps a
    gradient, only its importance weight is truncated (PPO instead zeroes clipped tokens).
    Defaults: ``eps_low = 1.0`` puts the lower bound at 0, i.e. no lower clip, as MiniMax-M1 ran
    it; ``eps_high = 3.0`` caps the weight at 4. MiniMax-M1 tuned eps_high without publishing a
    value and later setups use eps_high from 0.2 to 5 (a cap of 4 is common in ports of the
    ScaleRL recipe, Khatri et al. 2025, arXiv 2510.13786). A cap of a few units keeps a real IS
    correction for stale tokens in asynchronous training while still bounding the weight's variance;
    a cap near 1 would reduce CISPO to plain REINFORCE on exactly the tokens that drifted most.
    ``token-mean`` is the paper's normalisation by the total token count.
    Metric: ``clip/frac``, the fraction of counted tokens whose weight was truncated.
    """
    ratio_BT = clamped_exp(proximal_log_ratio(inp).detach())
    weight_BT = ratio_BT.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss_BT = -weight_BT * inp.adv_BT * inp.logprobs
    loss = aggregate(loss_BT, inp.mask, loss_agg, max_len)
    truncated_BT = (ratio_BT > 1.0 + eps_high) | (ratio_BT < 1.0 - eps_low)
    return ObjectiveOutput(loss, {"clip/frac": masked_fraction(truncated_BT, inp.mask)})
