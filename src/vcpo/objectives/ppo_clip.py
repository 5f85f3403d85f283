"""PPO-clip / GRPO with DAPO's clip-higher and the dual-clip for negative advantages."""

from __future__ import annotations

import torch

from vcpo.objectives.aggregation import aggregate
from vcpo.objectives.common import clamped_exp, proximal_log_ratio
from vcpo.objectives.diagnostics import masked_fraction
from vcpo.objectives.registry import register
from vcpo.objectives.types import ObjectiveInputs, ObjectiveOutput


@register("ppo_clip", "grpo")
def ppo_clip(
    inp: ObjectiveInputs,
    *,
    loss_agg: str = "token-mean",
    max_len: int | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> ObjectiveOutput:
    """``l = max(-A*r, -A*clip(r, 1-eps_low, 1+eps_high))`` with ``r = exp(lp - olp)``.

    ``olp`` is ``old_logprobs`` when given, else the behavior log-probs ("bypass mode").
    Dual-clip (Ye et al. 2020, arXiv 1912.09729), for A < 0 only: ``l = min(l, -A*c)``, c > 1
    (3 is usual). Schulman et al. 2017 (arXiv 1707.06347); GRPO: Shao et al. 2024 (arXiv 2402.03300);
    clip-higher eps_high = 0.28: DAPO, Yu et al. 2025 (arXiv 2503.14476). Defaults 0.2 / 0.2,
    no dual-clip, token-mean aggregation.
    """
    loss_BT, metrics = clipped_surrogate(inp, eps_low, eps_high, dual_clip)
    return ObjectiveOutput(aggregate(loss_BT, inp.mask, loss_agg, max_len), metrics)


def clipped_surrogate(
    inp: ObjectiveInputs, c_low: float, c_high: float, dual_clip: float | None, log_ratio=None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token PPO-clip loss with bounds ``[1 - c_low, 1 + c_high]`` and its clip diagnostics.

    Shared by ``ppo_clip``, ``icepop`` and ``bapo``; ``log_ratio`` defaults to ``lp - olp``.
    """
    d = proximal_log_ratio(inp) if log_ratio is None else log_ratio
    adv = inp.adv_BT
    ratio = clamped_exp(d)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - c_low, 1.0 + c_high)
    loss = torch.maximum(unclipped, clipped)
    m = inp.mask
    r = ratio.detach()
    # A token is clipped when the clipped branch wins strictly (its gradient is then zero).
    is_clipped = clipped.detach() > unclipped.detach()
    metrics = {
        "clip/frac": masked_fraction(is_clipped, m),
        "clip/frac_low": masked_fraction(is_clipped & (r < 1.0 - c_low), m),
        "clip/frac_high": masked_fraction(is_clipped & (r > 1.0 + c_high), m),
    }
    if dual_clip is not None:
        dual = -adv * dual_clip
        dual_hit = (adv < 0) & (dual.detach() < loss.detach())
        loss = torch.where(adv < 0, torch.minimum(loss, dual), loss)
        metrics["clip/frac_dual"] = masked_fraction(dual_hit, m)
    return loss, metrics
