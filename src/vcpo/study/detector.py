"""Early-warning rules tuned on one warm start's cells and scored on the others' (held out): a trivial baseline
(the smoothed ESS ratio below a threshold), a rule on the training reward's fall from its best, and the ESS level
gated by a weak gradient (issue 26), with recall, false alarms and lead time on each split.

A rule runs online (vcpo.loop.rules: ``Rule``, ``RuleTracker``, one metrics line at a time): the live health monitor
of the trainer (vcpo.loop.alarms) runs ``ESS_ALARM``, the ESS rule tuned here.
"""

from __future__ import annotations

import statistics
from itertools import product
from typing import Any

from vcpo.loop.rules import ESS_ALARM, Rule, RuleTracker
from vcpo.study.collapse import evaluate_warnings

__all__ = ["BASELINE_RULES", "ESS_ALARM", "GRAD_RULES", "REWARD_RULES", "Rule", "RuleTracker", "detector_split",
           "preference", "score", "tune"]

MAX_FALSE_ALARM_RATE = 0.2
"""The goal (issue 17): warn before >= 80% of collapses with false alarms in < 20% of the runs that do not."""
EPISODE_GAP = 25
"""A warning more than this many steps after the previous one starts a new alarm (for alarms per run)."""


BASELINE_RULES = [Rule(smooth=s, ess_below=x, warmup=w)
                  for w, s, x in product((20, 10, 5), (1, 5, 10, 25), (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5))]
"""The trivial baseline: "warn when the ESS ratio is below x". Its first step is tuned too: in lagged mode a
collapse can come within the first k steps (study2: by step 25 at k = 64), while the lag still ramps up."""
REWARD_RULES = [Rule(smooth=s, reward_drop=d, ess_below=x)
                for s, d, x in product((10, 25, 50), (0.1, 0.15, 0.2, 0.3, 0.4), (None, 0.3, 0.6))]
"""The candidate: the training reward falls from its best (optionally while the ESS ratio is low)."""
GRAD_RULES = [Rule(smooth=s, ess_below=x, grad_below=g, grad_smooth=gs)
              for s, x, gs, g in product((5, 10, 25), (0.1, 0.15, 0.2, 0.25, 0.3, 0.4), (10, 25),
                                         (0.8, 1.0, 1.2, 1.4, 1.6, 2.0))]
"""Issue 26's candidate: the ESS level while the gradient is weak. On study2 the runs that collapsed sat at a low
ESS with a gradient norm (before clipping) near 1, where full-VCPO runs sit at as low an ESS with norms near 2:
a low ESS with a strong gradient is a run still learning from its few effective samples."""

def score(rule: Rule, cells: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`evaluate_warnings` of the rule's warnings on ``cells`` (each with ``records`` and
    ``collapse_step``), plus alarms per stable run (warnings more than EPISODE_GAP steps apart count apart)."""
    warned = [{"collapse_step": c["collapse_step"], "warning_steps": rule.warning_steps(c["records"])} for c in cells]
    result = evaluate_warnings(warned)
    stable = [w["warning_steps"] for w in warned if w["collapse_step"] is None]
    episodes = [sum(1 for i, s in enumerate(ws) if i == 0 or s - ws[i - 1] > EPISODE_GAP) for ws in stable]
    return result | {"alarms_per_stable_run": statistics.fmean(episodes) if episodes else None}


def preference(result: dict[str, Any]) -> tuple[float, ...]:
    """Within the false-alarm goal, most recall, then fewest false alarms, then the longest lead; when no rule
    meets the goal, recall minus false-alarm rate (Youden's J) first."""
    recall, far = result["recall"] or 0.0, result["false_alarm_rate"] or 0.0
    lead = result["median_lead_steps"] or 0.0
    within = far < MAX_FALSE_ALARM_RATE
    return (within, recall if within else recall - far, -far, lead)


def tune(rules: list[Rule], cells: list[dict[str, Any]]) -> tuple[Rule, dict[str, Any]] | None:
    """The rule ``preference`` ranks first on ``cells`` (earliest in ``rules`` on ties) and its score; None when
    no cell collapsed (nothing to tune on)."""
    scored = [(rule, score(rule, cells)) for rule in rules]
    if not scored or scored[0][1]["collapsed"] == 0:
        return None
    return max(scored, key=lambda pair: preference(pair[1]))


def detector_split(cells: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str] | None:
    """(tuning cells, held-out cells, what split them): the first warm start's cells against the others'; for
    cells without recorded warm starts, the lowest seed's against the others' (in issue 5's study every seed
    had its own SFT warm start). When the first has no collapse to tune on, the first that has one is the
    tuning split instead (said in the description). None when there is only one warm start and one seed."""
    for key, label in (("warm_start", "warm start"), ("seed", "seed")):
        values = sorted({c.get(key) for c in cells if c.get(key) is not None}, key=str)
        if len(values) >= 2 and all(c.get(key) is not None for c in cells):
            collapsed = {c[key] for c in cells if c["collapse_step"] is not None}
            first = next((v for v in values if v in collapsed), values[0])
            others = [v for v in values if v != first]
            note = "" if first == values[0] else f" ({label} {values[0]} had no collapse to tune on)"
            return ([c for c in cells if c[key] == first], [c for c in cells if c[key] != first],
                    f"tuned on {label} {first}{note}, held out: {label}s {', '.join(map(str, others))}")
    return None
