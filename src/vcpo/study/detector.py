"""Early-warning rules tuned on one warm start's cells and scored on the others' (held out): a trivial baseline
(the smoothed ESS ratio below a threshold), a rule on the training reward's fall from its best, and the ESS level
gated by a weak gradient (issue 26), with recall, false alarms and lead time on each split.

A rule runs online (:class:`RuleTracker`, one metrics line at a time, its state JSON-serialisable): the live
health monitor of the trainer (vcpo.loop.alarms) runs :data:`ESS_ALARM`, the ESS rule tuned here.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from itertools import product
from typing import Any

from vcpo.study.collapse import evaluate_warnings

MAX_FALSE_ALARM_RATE = 0.2
"""The goal (issue 17): warn before >= 80% of collapses with false alarms in < 20% of the runs that do not."""
EPISODE_GAP = 25
"""A warning more than this many steps after the previous one starts a new alarm (for alarms per run)."""


@dataclass(frozen=True)
class Rule:
    """Warn at step t (t >= ``warmup``) when every enabled condition holds, with means over the last ``smooth``
    steps (a full window):
    - ``ess_below``: their mean ESS ratio is below it;
    - ``reward_drop``: their mean training reward is below (1 - reward_drop) x the best such mean so far, once that
      best reaches ``reward_floor``;
    - ``grad_below``: the mean gradient norm (before clipping) of the last ``grad_smooth`` finite ones is below it.
    Only per-step training metrics are read, one line at a time, so the rule runs online."""

    smooth: int = 10
    ess_below: float | None = None
    reward_drop: float | None = None
    warmup: int = 20
    """No rule fires before this step: the first steps' signals are noisy and, in lagged mode, come from a lag
    that is still ramping up (step t trains on the samples of version max(0, t - k))."""
    grad_below: float | None = None
    grad_smooth: int = 25
    reward_floor: float = 0.0

    def describe(self) -> str:
        parts = []
        if self.ess_below is not None:
            parts.append(f"the ESS ratio's {self.smooth}-step mean < {self.ess_below:g}")
        if self.reward_drop is not None:
            floor = f" (once that best is >= {self.reward_floor:g})" if self.reward_floor > 0 else ""
            parts.append(f"the training reward's {self.smooth}-step mean < {1 - self.reward_drop:g} x its best so "
                         f"far{floor}")
        if self.grad_below is not None:
            parts.append(f"the gradient norm's {self.grad_smooth}-step mean < {self.grad_below:g}")
        return " and ".join(parts) + f", from step {self.warmup}"

    def tracker(self, state: dict[str, Any] | None = None) -> RuleTracker:
        """A fresh online tracker of this rule (or one resumed from ``state``, what ``RuleTracker.state`` gave)."""
        tracker = RuleTracker(self)
        if state:
            tracker.load_state(state)
        return tracker

    def warning_steps(self, records: list[dict[str, Any]]) -> list[int]:
        """Every step at which the rule warns over a run's metrics lines (in step order)."""
        tracker = self.tracker()
        return [int(record["step"]) for record in records if tracker.update(record)]


@dataclass
class RuleTracker:
    """A rule's running windows (sums kept alongside, so that a step costs O(1)) and the best smoothed reward."""

    rule: Rule
    best_reward: float = -math.inf
    ess: deque[float] = field(default_factory=deque)
    reward: deque[float] = field(default_factory=deque)
    grad: deque[float] = field(default_factory=deque)
    means: dict[str, float] = field(default_factory=dict)
    """The smoothed quantities of the last update: ``ess``, ``reward``, ``reward_best`` and ``grad_norm``."""

    def update(self, record: dict[str, Any]) -> bool:
        """Feed one metrics line (``step``, ``ess/ratio``, ``reward/mean``, ``grad_norm``); True if the rule warns.
        A line without a finite ESS ratio or reward is passed over (a skipped step's ESS may be NaN)."""
        ess, reward, grad = record.get("ess/ratio"), record.get("reward/mean"), record.get("grad_norm")
        if _finite(grad):
            _push(self.grad, float(grad), self.rule.grad_smooth)
        if not _finite(ess) or not _finite(reward):
            return False
        rule = self.rule
        _push(self.ess, float(ess), rule.smooth)
        _push(self.reward, float(reward), rule.smooth)
        if len(self.reward) < rule.smooth:
            return False
        recent_reward = math.fsum(self.reward) / rule.smooth
        self.means = {"ess": math.fsum(self.ess) / rule.smooth, "reward": recent_reward}
        if self.grad:
            self.means["grad_norm"] = math.fsum(self.grad) / len(self.grad)
        warn = record["step"] >= rule.warmup
        if rule.ess_below is not None:
            warn &= self.means["ess"] < rule.ess_below
        if rule.reward_drop is not None:
            warn &= self.best_reward >= rule.reward_floor and recent_reward < (1 - rule.reward_drop) * self.best_reward
        if rule.grad_below is not None:
            warn &= "grad_norm" in self.means and self.means["grad_norm"] < rule.grad_below
        self.best_reward = max(self.best_reward, recent_reward)
        self.means["reward_best"] = self.best_reward
        return bool(warn)

    def state(self) -> dict[str, Any]:
        return {"best_reward": self.best_reward if math.isfinite(self.best_reward) else None,
                "ess": list(self.ess), "reward": list(self.reward), "grad": list(self.grad)}

    def load_state(self, state: dict[str, Any]) -> None:
        best = state.get("best_reward")
        self.best_reward = -math.inf if best is None else float(best)
        self.ess, self.reward, self.grad = (deque(map(float, state.get(key, []))) for key in ("ess", "reward", "grad"))


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _push(window: deque[float], value: float, size: int) -> None:
    window.append(value)
    if len(window) > size:
        window.popleft()


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
ESS_ALARM = Rule(smooth=10, ess_below=0.2, grad_below=1.2, grad_smooth=25, warmup=20)
"""What :data:`GRAD_RULES` tuned on study2's warm start w0 chose (tests/test_study_detector.py checks it against
the committed cells); the trainer's ESS alarm. The gradient threshold is in the units of the study's model (the
embedded default, gradient norms before clipping): another model's norms differ (trainer.health.ess_grad_below)."""
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
