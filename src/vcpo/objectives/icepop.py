"""IcePop: PPO-clip with tokens masked out where training and inference probabilities disagree."""

from __future__ import annotations

import math

import torch

from vcpo.objectives.aggregation import aggregate
from vcpo.objectives.common import clamped_exp
from vcpo.objectives.diagnostics import masked_fraction
from vcpo.objectives.ppo_clip import clipped_surrogate
from vcpo.objectives.registry import register
from vcpo.objectives.types import ObjectiveInputs, ObjectiveOutput


@register("icepop")
def icepop(
    inp: ObjectiveInputs,
    *,
    loss_agg: str = "seq-mean-token-mean",
    max_len: int | None = None,
    low: float = 0.5,
    high: float = 5.0,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> ObjectiveOutput:
    """``l[i,t] = M(k[i,t]) * max(-A*r, -A*clip(r, 1-eps_low, 1+eps_high))`` (plus optional dual-clip).

    ``k = exp(sg(olp) - blp)`` is the training-vs-inference ratio of the sampled token, with
    ``olp = old_logprobs`` when given, else ``lp.detach()`` (so in bypass mode k = exp(lp - blp));
    tokens with k outside [low, high] are dropped (zero loss, zero gradient) and stay in the
    denominator (pre-mask token count). ``r`` is the PPO ratio of ``ppo_clip``: exp(lp - olp)
    when ``old_logprobs`` is given, else exp(lp - blp).

    The paper's mask function is ``M(k) = k`` inside [alpha, beta] and 0 outside, multiplying a
    PPO loss whose ratio is pi_theta / pi_train(theta_old). In bypass mode (no ``old_logprobs``)
    the PPO ratio is already taken against the behavior policy and so already contains k, and M
    reduces to the indicator 1[low <= k <= high]; this is the token mask of ALGORITHMS.md §3.
    With ``old_logprobs`` the ratio lacks the train/inference factor, so the kept tokens are
    also multiplied by ``sg(k)`` (k clamped in log space to [-20, 20]), as in the paper and in
    decoupled PPO. Either way the gradient of a kept token is ``-k * A * r * grad lp`` where r
    is unclipped.

    IcePop: Ling Team, "Every step evolves: scaling reinforcement learning for trillion-scale
    thinking model" (Ring-1T, arXiv 2510.18855), alpha = 0.5, beta = 5. PPO-clip and dual-clip
    as in ``ppo_clip`` (defaults 0.2 / 0.2, no dual-clip). Default aggregation
    seq-mean-token-mean, the paper's 1/G sum_i 1/|y_i| sum_t. Metrics: ``mask/frac`` (fraction
    of counted tokens dropped) and the ``clip/*`` fractions of ``ppo_clip`` over all counted
    tokens, dropped ones included.
    """

    mask = inp.mask
    train_lp_BT = inp.old_logprobs if inp.old_logprobs is not None else inp.logprobs
    log_k_BT = train_lp_BT.detach() - inp.behavior_logprobs.detach()
    log_k_BT = torch.where(mask.bool(), log_k_BT, torch.zeros_like(log_k_BT))
    log_low = math.log(low) if low > 0 else -math.inf
    keep_BT = (log_k_BT >= log_low) & (log_k_BT <= math.log(high))

    loss_BT, metrics = clipped_surrogate(inp, eps_low, eps_high, dual_clip)
    if inp.old_logprobs is not None:
        loss_BT = clamped_exp(log_k_BT) * loss_BT
    loss_BT = torch.where(keep_BT, loss_BT, torch.zeros_like(loss_BT))
    metrics["mask/frac"] = masked_fraction(~keep_BT, mask)
    return ObjectiveOutput(aggregate(loss_BT, mask, loss_agg, max_len), metrics)
