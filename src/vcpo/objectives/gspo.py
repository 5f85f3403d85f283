"""GSPO and GSPO-token: PPO clipping on the length-normalised sequence ratio (arXiv 2507.18071)."""

from __future__ import annotations

from torch import Tensor

from vcpo.objectives.aggregation import aggregate
from vcpo.objectives.common import clamped_exp, proximal_log_ratio
from vcpo.objectives.ppo_clip import clipped_surrogate
from vcpo.objectives.registry import register
from vcpo.objectives.types import ObjectiveInputs, ObjectiveOutput

GSPO_EPS_LOW = 3e-4
GSPO_EPS_HIGH = 4e-4


@register("gspo")
def gspo(
    inp: ObjectiveInputs,
    *,
    loss_agg: str = "seq-mean-token-mean",
    max_len: int | None = None,
    eps_low: float = GSPO_EPS_LOW,
    eps_high: float = GSPO_EPS_HIGH,
) -> ObjectiveOutput:
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071).

    ``s_i = exp((1/L_i) sum_t m*(lp - olp))`` (olp = old_logprobs, else behavior) and
    ``l_i = max(-A_i*s_i, -A_i*clip(s_i, 1-eps_low, 1+eps_high))``, broadcast to the tokens of
    sequence i. The gradient of an unclipped sequence is ``-A_i * s_i * (1/L_i) sum_t grad lp``.
    Defaults: the paper's eps 3e-4 / 4e-4 and ``seq-mean-token-mean``, which makes the loss
    exactly the paper's ``(1/G) sum_i l_i``. Per-token advantages [B, T] are accepted (each token
    clips with its own sign of A) but the paper's GSPO assumes one advantage per sequence; use
    ``gspo_token`` for genuinely per-token advantages.
    """
    log_s_B = _sequence_log_ratio(inp)
    log_ratio_BT = log_s_B.unsqueeze(1).expand_as(inp.logprobs)
    return _clipped_sequence_loss(inp, log_ratio_BT, log_s_B, eps_low, eps_high, loss_agg, max_len)


@register("gspo_token")
def gspo_token(
    inp: ObjectiveInputs,
    *,
    loss_agg: str = "seq-mean-token-mean",
    max_len: int | None = None,
    eps_low: float = GSPO_EPS_LOW,
    eps_high: float = GSPO_EPS_HIGH,
) -> ObjectiveOutput:
    """GSPO-token (Zheng et al. 2025, arXiv 2507.18071, the token-level variant).

    ``log s_it = sg(log s_i) + lp_it - sg(lp_it)``: the value of every token's ratio is the
    sequence ratio ``s_i`` but its gradient reaches only its own token, so
    ``l_it = max(-A_it*s_it, -A_it*clip(s_it, 1-eps_low, 1+eps_high))`` admits per-token
    advantages. The gradient of an unclipped token is ``-A_it * s_i * grad lp_it``; with one
    advantage per sequence and ``seq-mean-token-mean`` (the default) loss, clipping and gradient
    equal those of ``gspo``.
    """
    log_s_B = _sequence_log_ratio(inp)
    d_BT = proximal_log_ratio(inp)
    # d - sg(d) is zero in value and has gradient 1 wrt lp on counted tokens (0 on masked ones).
    log_ratio_BT = log_s_B.detach().unsqueeze(1) + d_BT - d_BT.detach()
    return _clipped_sequence_loss(inp, log_ratio_BT, log_s_B, eps_low, eps_high, loss_agg, max_len)


def _sequence_log_ratio(inp: ObjectiveInputs) -> Tensor:
    """[B] ``log s_i = sum_t m*(lp - olp) / L_i`` with gradient; 0 for a row with no counted token."""
    return proximal_log_ratio(inp).sum(dim=1) / inp.lengths.clamp(min=1.0)


def _clipped_sequence_loss(
    inp: ObjectiveInputs,
    log_ratio_BT: Tensor,
    log_s_B: Tensor,
    eps_low: float,
    eps_high: float,
    loss_agg: str,
    max_len: int | None,
) -> ObjectiveOutput:
    # The token-level clip fractions of clipped_surrogate are replaced by sequence-level ones.
    loss_BT, _ = clipped_surrogate(inp, eps_low, eps_high, None, log_ratio=log_ratio_BT)
    loss = aggregate(loss_BT, inp.mask, loss_agg, max_len)
    return ObjectiveOutput(loss, _sequence_clip_metrics(inp, log_s_B, eps_low, eps_high))


def _sequence_clip_metrics(inp: ObjectiveInputs, log_s_B: Tensor, eps_low: float, eps_high: float) -> dict[str, float]:
    """Fractions of non-empty sequences clipped (low / high) and the mean sequence ratio.

    A sequence counts as clipped when the clipped branch wins on any of its counted tokens, which
    with one advantage per sequence means: A > 0 and s > 1+eps_high, or A < 0 and s < 1-eps_low.
    The ratio reported is the one the loss used (log-ratio clamped to [-20, 20]).
    """
    m_BT = inp.mask.bool()
    nonempty_B = m_BT.any(dim=1)
    n = int(nonempty_B.sum())
    if n == 0:
        return {"clip/frac": 0.0, "clip/frac_low": 0.0, "clip/frac_high": 0.0, "gspo/seq_ratio_mean": 0.0}
    s_B = clamped_exp(log_s_B.detach())
    adv_BT = inp.adv_BT
    s_BT = s_B.unsqueeze(1)
    low_B = ((adv_BT < 0) & (s_BT < 1.0 - eps_low) & m_BT).any(dim=1)
    high_B = ((adv_BT > 0) & (s_BT > 1.0 + eps_high) & m_BT).any(dim=1)
    return {
        "clip/frac": float((low_B | high_B).sum()) / n,
        "clip/frac_low": float(low_B.sum()) / n,
        "clip/frac_high": float(high_B.sum()) / n,
        "gspo/seq_ratio_mean": float(s_B[nonempty_B].double().mean()),
    }

