"""M2PO: a second-moment trust region that masks the fewest extreme tokens (mask variant)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vcpo.objectives.aggregation import aggregate
from vcpo.objectives.common import clamped_exp, proximal_log_ratio
from vcpo.objectives.diagnostics import masked_fraction, masked_mean
from vcpo.objectives.registry import register
from vcpo.objectives.types import ObjectiveInputs, ObjectiveOutput


@register("m2po", scope="batch")
def m2po(
    inp: ObjectiveInputs,
    *,
    loss_agg: str = "token-mean",
    max_len: int | None = None,
    tau: float = 0.04,
    behavior_weight_max: float | None = None,
) -> ObjectiveOutput:
    """``l[i,t] = -M[i,t] * r[i,t] * A[i,t]``, M the second-moment mask, r unclipped.

    Second moment ``M2 = mean over counted tokens of (blp - olp)^2``, with
    ``olp = old_logprobs`` when given, else ``lp.detach()``. ``M`` keeps the largest set of
    tokens whose mean squared log-ratio is <= tau, which is the set of the k smallest squared
    log-ratios (see ``second_moment_keep_mask``): the fewest, most extreme tokens are masked.
    The mask is global over the batch. ``r = exp(lp - old_logprobs)`` when given, else
    ``exp(lp - blp)`` (log-ratio clamped to [-20, 20]); there is no eps-clip. Masked tokens keep
    their place in the denominator (pre-mask token count). With ``lp == blp`` and no
    ``old_logprobs``, M2 = 0, nothing is masked, r = 1 and the gradient is REINFORCE's.

    Zheng et al. 2025, "Prosperity before collapse: how far can off-policy RL reach with stale
    data on LLMs?" (arXiv 2510.01161), tau_M2 = 0.04, token-mean (1 / sum_i |o_i|). This is the
    MASK variant, the paper's canonical M2PO; the other published variant, which turns the
    budget into global PPO clip bounds over "harmful" tokens only, is not implemented.

    Decoupled mode's behavior weight, ``behavior_weight_max`` (``c``): the paper's objective is
    ``M * pi_theta / pi_old * A`` with no further factor, which is the default (None). AReaL's M2PO
    example (``examples/math/gsm8k_m2po.yaml``: ``use_decoupled_loss: true`` with
    ``rejection_sampling: {metric: ratio, upper: 5.0}``, i.e. token level, action mask, no lower
    bound) applies the pi_old/mu factor: ``k = exp(olp - blp)`` per token, tokens with ``k > 5``
    dropped, the kept ones' loss multiplied by ``sg(k)``. ``behavior_weight_max=c`` does exactly that
    when ``old_logprobs`` is given (c = inf keeps every token; k clamped in log space to [-20, 20]);
    in bypass mode ``r = exp(lp - blp)`` already holds k, so only the drop ``k > c`` applies (k
    being ``exp(sg(lp) - blp)`` there), as in ``icepop``. Dropped tokens stay in the denominator.

    Metrics: ``m2po/m2_before`` (M2 over all counted tokens), ``m2po/m2_after`` (over the tokens the
    second-moment mask keeps, 0 when none is kept), ``m2po/behavior_drop_frac`` (fraction of counted
    tokens dropped for ``k > c``, 0 when c is None) and ``mask/frac`` (fraction of counted tokens
    masked by either).
    """
    mask = inp.mask.bool()
    olp_BT = inp.old_logprobs if inp.old_logprobs is not None else inp.logprobs
    sq_BT = (inp.behavior_logprobs.detach() - olp_BT.detach()) ** 2
    sq_BT = torch.where(mask, sq_BT, torch.zeros_like(sq_BT))
    m2_keep_BT = second_moment_keep_mask(sq_BT, mask, tau)

    ratio_BT = clamped_exp(proximal_log_ratio(inp))
    loss_BT = -ratio_BT * inp.adv_BT
    behavior_keep_BT = mask
    if behavior_weight_max is not None:
        # log k = olp - blp; in bypass mode olp = sg(lp), so k is r's value and only its bound applies.
        log_k_BT = torch.where(mask, olp_BT.detach() - inp.behavior_logprobs.detach(), torch.zeros_like(loss_BT))
        behavior_keep_BT = mask & (log_k_BT <= math.log(behavior_weight_max))
        if inp.old_logprobs is not None:
            loss_BT = clamped_exp(log_k_BT) * loss_BT
    keep_BT = m2_keep_BT & behavior_keep_BT
    loss_BT = torch.where(keep_BT, loss_BT, torch.zeros_like(loss_BT))
    metrics = {
        "m2po/m2_before": masked_mean(sq_BT, mask),
        "m2po/m2_after": masked_mean(sq_BT, m2_keep_BT),
        "m2po/behavior_drop_frac": masked_fraction(mask & ~behavior_keep_BT, mask),
        "mask/frac": masked_fraction(mask & ~keep_BT, mask),
    }
    return ObjectiveOutput(aggregate(loss_BT, inp.mask, loss_agg, max_len), metrics)


def second_moment_keep_mask(sq_BT: Tensor, mask_BT: Tensor, tau: float) -> Tensor:
    """[B, T] bool: the counted tokens kept so that their mean of ``sq`` is <= ``tau``.

    Sorting the counted values ascending, the prefix means are non-decreasing (each new value is
    at least every earlier one, hence at least their mean), so the largest kept set is the
    longest prefix whose mean is <= tau, found in one pass over the cumulative sums. Any set of
    k tokens has a mean at least that of the k smallest, so no larger set qualifies, and masking
    the complement masks the fewest tokens. If even the smallest value exceeds tau, all counted
    tokens are masked. Ties at the boundary are broken by the stable sort order.
    """
    mask_BT = mask_BT.bool()
    values = sq_BT.detach().double()[mask_BT]
    order = torch.argsort(values, stable=True)
    counts = torch.arange(1, values.numel() + 1, dtype=values.dtype, device=values.device)
    # sum_k <= tau * k is the prefix-mean test without a division.
    n_keep = int((values[order].cumsum(0) <= tau * counts).sum())
    keep_flat = torch.zeros_like(values, dtype=torch.bool)
    keep_flat[order[:n_keep]] = True
    keep_BT = torch.zeros_like(mask_BT, dtype=torch.bool)
    keep_BT[mask_BT] = keep_flat
    return keep_BT
