"""BAPO: PPO-clip whose ratio bounds are re-chosen at every call to balance the positive- and
negative-advantage contributions of the batch."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vcpo.objectives.aggregation import aggregate
from vcpo.objectives.common import clamped_exp, proximal_log_ratio
from vcpo.objectives.ppo_clip import clipped_surrogate
from vcpo.objectives.registry import register
from vcpo.objectives.types import ObjectiveInputs, ObjectiveOutput

MAX_CANDIDATES = 10_000
"""Upper limit on the number of (c_low, c_high) pairs one search may visit (guards a tiny step)."""

DEFAULT_STEP = 0.05
"""The increment of each bound when neither ``step`` nor ``step_low`` / ``step_high`` is given."""

RATIO_REPORT_CAP = 1e6
"""``bapo/pos_neg_ratio`` is reported as min(P/N, 1e6) so that N = 0 stays a finite float."""


def bound_schedule(c_low: float, c_low_max: float, c_high: float, c_high_max: float,
                   step_low: float, step_high: float, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """The pairs the search visits, in order: c_low rises by ``step_low`` to ``c_low_max`` (c_high at
    its start), then c_high rises by ``step_high`` to ``c_high_max``; the last step of each stops at
    the max. Values are ``start + j*step`` (not repeated additions) so they carry no drift. Float64
    tensors on ``device`` (that of the ratios they are compared with)."""
    def n_steps(start: float, stop: float, step: float) -> int:
        # The tolerance keeps (0.8 - 0.6) / 0.05 = 4.000000000000001 from adding a fifth, empty step.
        return max(math.ceil((stop - start) / step - 1e-9), 0)

    n_low, n_high = n_steps(c_low, c_low_max, step_low), n_steps(c_high, c_high_max, step_high)
    if n_low + n_high + 1 > MAX_CANDIDATES:
        name, value = ("step_low", step_low) if n_low >= n_high else ("step_high", step_high)
        raise ValueError(f"hyperparameter {name}={value!r} is too small: the bound search would visit "
                         f"more than {MAX_CANDIDATES} candidates")
    lows = [min(c_low + j * step_low, c_low_max) for j in range(n_low + 1)]
    highs = [min(c_high + j * step_high, c_high_max) for j in range(n_high + 1)]
    low_K = lows + [lows[-1]] * (len(highs) - 1)
    high_K = [highs[0]] * len(lows) + highs[1:]
    return (torch.tensor(low_K, dtype=torch.float64, device=device),
            torch.tensor(high_K, dtype=torch.float64, device=device))


def resolve_steps(step: float | None, step_low: float | None, step_high: float | None) -> tuple[float, float]:
    """(step_low, step_high): ``step`` is the shortcut that sets both, so giving it together with
    either of them is an error; an unset step is ``DEFAULT_STEP``."""
    if step is not None and (step_low is not None or step_high is not None):
        given = "step_low" if step_low is not None else "step_high"
        raise ValueError(f"hyperparameter step={step!r} sets both bounds' steps: give step or "
                         f"step_low/step_high, not both ({given} is given too)")
    low = step if step is not None else (DEFAULT_STEP if step_low is None else step_low)
    high = step if step is not None else (DEFAULT_STEP if step_high is None else step_high)
    return low, high


def contributions(ratio_N: Tensor, adv_N: Tensor, c_low_K: Tensor, c_high_K: Tensor) -> tuple[Tensor, Tensor]:
    """``P_K = sum_{A>0} min(r, c_high) * A`` and ``N_K = sum_{A<0} max(r, c_low) * |A|`` for every
    candidate at once, over the counted tokens given as flat ``ratio_N`` / ``adv_N`` (float64).

    Sorting the ratios once turns each sum into prefix sums: with the positive tokens sorted by r,
    ``P(c) = sum_{r<=c} r*A + c * sum_{r>c} A``; likewise ``N(c) = c * sum_{r<c} |A| + sum_{r>=c} r*|A|``.
    Cost O(n log n + K log n) and O(n + K) memory, whatever the number of candidates K.
    """
    def sorted_prefix(sel: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        r, order = torch.sort(ratio_N[sel])
        a = adv_N[sel].abs()[order]
        zero = r.new_zeros(1)
        return r, torch.cat([zero, torch.cumsum(a, 0)]), torch.cat([zero, torch.cumsum(r * a, 0)])

    r_pos, cum_a_pos, cum_ra_pos = sorted_prefix(adv_N > 0)
    below = torch.searchsorted(r_pos, c_high_K, right=True)  # tokens with r <= c_high keep r
    p_K = cum_ra_pos[below] + c_high_K * (cum_a_pos[-1] - cum_a_pos[below])
    r_neg, cum_a_neg, cum_ra_neg = sorted_prefix(adv_N < 0)
    below = torch.searchsorted(r_neg, c_low_K, right=False)  # tokens with r < c_low are lifted to c_low
    n_K = c_low_K * cum_a_neg[below] + (cum_ra_neg[-1] - cum_ra_neg[below])
    return p_K, n_K


@register("bapo", scope="batch")
def bapo(
    inp: ObjectiveInputs,
    *,
    loss_agg: str = "token-mean",
    max_len: int | None = None,
    target: float = 1.0,
    c_low: float = 0.6,
    c_low_max: float = 0.8,
    c_high: float = 1.2,
    c_high_max: float = 2.0,
    step: float | None = None,
    step_low: float | None = None,
    step_high: float | None = None,
    dual_clip: float | None = 3.0,
) -> ObjectiveOutput:
    """PPO-clip ``l = max(-A*r, -A*clip(r, c_lo, c_hi))`` (+ dual-clip ``min(l, -A*c)`` for A < 0)
    with ``[c_lo, c_hi]`` chosen afresh for this batch. BAPO, Xi et al. 2025, arXiv 2510.18927.

    ``r = exp(lp - olp)`` (``old_logprobs``, else behavior). The bounds are absolute ratio bounds,
    not epsilons. Per counted token, ``r_eff = min(r, c_hi)`` if A >= 0 else ``max(r, c_lo)``;
    ``P = sum_{A>0} r_eff*A``, ``N = sum_{A<0} r_eff*|A|``. Starting from (c_low, c_high) =
    (0.6, 1.2), while ``P/N < target`` (1.0): raise c_lo by ``step_low`` (0.05) up to ``c_low_max``
    (0.8), then c_hi by ``step_high`` (0.05) up to ``c_high_max`` (2.0); the first pair meeting the
    target is used, else the last one. The test is ``P >= target * N``, so a batch with no
    negative contribution (N = 0) keeps the start bounds. The search is stateless and uses
    detached values. Default dual-clip c = 3; token-mean aggregation.

    ``step`` is the shortcut that sets both increments; giving it together with ``step_low`` or
    ``step_high`` raises ``ValueError``; an increment left unset is 0.05. The authors' example
    (``recipe/bapo/run_bapo_example.sh``: lower 0.8 -> 0.95 by 0.05, upper 1.2 -> 2.0 by 0.1,
    target 0.5) is ``target=0.5, c_low=0.8, c_low_max=0.95, step_low=0.05, step_high=0.1``.

    Metrics: ``bapo/c_low``, ``bapo/c_high``, ``bapo/pos_neg_ratio`` (P/N at the chosen bounds,
    reported as min(P/N, 1e6); 1.0 when P = N = 0), plus the ``clip/*`` fractions of ``ppo_clip``.
    """
    c_low_K, c_high_K = bound_schedule(c_low, c_low_max, c_high, c_high_max, *resolve_steps(step, step_low, step_high),
                                       device=inp.logprobs.device)
    m = inp.mask.bool()
    ratio_N = clamped_exp(proximal_log_ratio(inp).detach())[m].double()
    adv_N = inp.adv_BT[m].double()
    p_K, n_K = contributions(ratio_N, adv_N, c_low_K, c_high_K)
    met_K = p_K >= target * n_K
    # The first candidate that meets the target, else the last (both maxima reached).
    k = int(torch.argmax(met_K.to(torch.int8))) if bool(met_K.any()) else len(met_K) - 1
    lo, hi = float(c_low_K[k]), float(c_high_K[k])
    loss_BT, metrics = clipped_surrogate(inp, 1.0 - lo, hi - 1.0, dual_clip)
    p, n = float(p_K[k]), float(n_K[k])
    metrics["bapo/c_low"] = lo
    metrics["bapo/c_high"] = hi
    metrics["bapo/pos_neg_ratio"] = min(p / n, RATIO_REPORT_CAP) if n > 0 else (RATIO_REPORT_CAP if p > 0 else 1.0)
    return ObjectiveOutput(aggregate(loss_BT, inp.mask, loss_agg, max_len), metrics)
