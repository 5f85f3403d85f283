"""The online form of the collapse rules (issue 26): a :class:`Rule` on each step's metrics line, its running
state in a :class:`RuleTracker` (JSON-serialisable, so it survives a checkpoint), and :data:`ESS_ALARM`, the rule the
trainer's ``ess`` alarm runs (vcpo.loop.alarms). The rules were tuned offline on the staleness study's cells
(vcpo.study.detector), which imports them from here.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any


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


ESS_ALARM = Rule(smooth=10, ess_below=0.2, grad_below=1.2, grad_smooth=25, warmup=20)
"""What vcpo.study.detector's ``GRAD_RULES`` tuned on study2's warm start w0 chose (tests/test_study_detector.py
checks it against the committed cells); the trainer's ESS alarm. The gradient threshold is in the units of the study's
model (the embedded default, gradient norms before clipping): another model's norms differ
(trainer.health.ess_grad_below)."""
