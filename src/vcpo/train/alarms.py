"""Live health alarms: rules computed from each step's metrics line (and its evaluation), in every mode and backend,
since every run goes through the same loop (docs/trainer.md, health alarms).

Rules, with the thresholds of ``trainer.health`` (h):
- ``nonfinite``: the learner skipped the step (a non-finite loss, ESS, gradient norm or sampled log-prob).
- ``dead_policy``: for ``h.dead_steps`` steps in a row, the mean negative log-prob of the sampled tokens,
  ``-E[log pi_behavior(y_t)]`` (a Monte-Carlo estimate of the per-token entropy), is below ``h.dead_entropy`` and
  the gradient norm is finite and below ``h.dead_grad_norm``: the policy samples one answer and learns nothing.
- ``reward_collapse``: the training reward's ``h.reward_smooth``-step mean is below ``(1 - h.reward_drop)`` x its
  best such mean so far, once that best is at least ``h.reward_floor``.
- ``ess``: the ESS ratio's ``h.ess_smooth``-step mean is below ``h.ess_below`` while the gradient norm's
  ``h.grad_smooth``-step mean is below ``h.ess_grad_below``: the early-warning rule tuned offline
  (vcpo.study.detector.ESS_ALARM, the same code); a low ESS alone does not fire it (full-VCPO runs sit there).
- ``accuracy_fall``: held-out accuracy is below ``h.accuracy_fall`` x its best so far (the evaluation before RL
  included), and below it by more than two binomial standard errors of that best, ``2 sqrt(b (1 - b) / n)`` over
  the n evaluation problems (1 of 16 problems right, then none, is noise), at ``h.accuracy_evals`` evaluations in a
  row.
``reward_collapse`` and ``ess`` fire from step ``h.warmup`` on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from vcpo.config import HealthConfig
from vcpo.study.detector import Rule

RULES = ("nonfinite", "dead_policy", "reward_collapse", "ess", "accuracy_fall")


@dataclass(frozen=True)
class Remedy:
    """What ``trainer.on_alarm: rollback`` changes after a rule fired, on top of going back to a checkpoint: the
    learning rate is multiplied by ``lr_factor``. With ``async.max_staleness: auto`` the trainer also lowers the
    checkpoint's staleness bound once (the controller's multiplicative decrease), whichever rule fired."""

    lr_factor: float = 0.5


REMEDIES = dict.fromkeys(RULES, Remedy())
"""Every rule's remedy: halve the learning rate (the usual cure of a diverging or dying policy)."""


@dataclass(frozen=True)
class Alarm:
    """A rule that fired at ``step``. ``last_good``: the newest step whose weights it does not suspect (step t's
    metrics come from the weights of step t - 1, so a rule whose evidence starts at step s suspects step s - 1's)."""

    rule: str
    step: int
    last_good: int
    detail: str
    repeat: bool = False

    def line(self) -> str:
        return f"health alarm at step {self.step}: {self.rule}: {self.detail}"


class HealthMonitor:
    """The rules' running state. ``observe`` takes each finished step's metrics and returns the alarms it raises;
    ``metrics`` are the ``health/*`` values of that step's line: ``health/alarm_<rule>`` (1.0 when the rule
    fires, else 0.0) and the monitored quantities. ``state`` goes into checkpoints: ``windows`` (what the rules
    have seen: rewound by a rollback) and ``totals`` (alarm counts, rollbacks, the learning-rate factor: kept)."""

    def __init__(self, config: HealthConfig, state: dict[str, Any] | None = None) -> None:
        self.config = config
        c = config
        self.ess_rule = Rule(smooth=c.ess_smooth, ess_below=c.ess_below, grad_below=c.ess_grad_below,
                             grad_smooth=c.grad_smooth, warmup=c.warmup)
        self.reward_rule = Rule(smooth=c.reward_smooth, reward_drop=c.reward_drop, reward_floor=c.reward_floor,
                                warmup=c.warmup)
        state = state or {}
        totals = state.get("totals", {})
        self.counts: dict[str, int] = {rule: int(totals.get("counts", {}).get(rule, 0)) for rule in RULES}
        self.rollbacks = int(totals.get("rollbacks", 0))
        self.lr_factor = float(totals.get("lr_factor", 1.0))
        self.rewind(state.get("windows"))
        self.metrics: dict[str, float] = {}

    def rewind(self, windows: dict[str, Any] | None) -> None:
        """Back to the rules' state of a checkpoint (None: a fresh run's)."""
        windows = windows or {}
        self.ess = self.ess_rule.tracker(windows.get("ess"))
        self.reward = self.reward_rule.tracker(windows.get("reward"))
        self.dead_streak = int(windows.get("dead_streak", 0))
        self.low_evals = int(windows.get("low_evals", 0))
        best = windows.get("best_accuracy")
        self.best_accuracy: float | None = None if best is None else float(best)
        self.good_eval = int(windows.get("good_eval", 0))
        self.firing: set[str] = set(windows.get("firing", []))

    def state(self) -> dict[str, Any]:
        return {
            "windows": {"ess": self.ess.state(), "reward": self.reward.state(), "dead_streak": self.dead_streak,
                        "low_evals": self.low_evals, "best_accuracy": self.best_accuracy, "good_eval": self.good_eval,
                        "firing": sorted(self.firing)},
            "totals": {"counts": self.counts, "rollbacks": self.rollbacks, "lr_factor": self.lr_factor},
        }

    def rolled_back(self, checkpoint_state: dict[str, Any] | None, lr_factor: float) -> None:
        """After a rollback to a checkpoint (its ``state()``): the rules' windows as they were then; one more
        rollback and the learning rate's factor times ``lr_factor``."""
        self.rewind((checkpoint_state or {}).get("windows"))
        self.firing = set()
        self.rollbacks += 1
        self.lr_factor *= lr_factor

    def observe(self, metrics: dict[str, Any], skip_reason: str | None = None) -> list[Alarm]:
        """The alarms a finished step raises (each enabled rule's), given its metrics line; ``repeat`` marks a rule
        that fired on the step before too (the console says so once)."""
        step = int(metrics["step"])
        self.metrics = {}
        found = [self._nonfinite(metrics, step, skip_reason), self._dead(metrics, step),
                 *self._windowed(metrics, step), self._accuracy(metrics, step)]
        alarms = [replace(a, repeat=a.rule in self.firing) for a in found
                  if a is not None and a.rule not in self.config.disabled]
        self.firing = {a.rule for a in alarms}
        for rule in self.firing:
            self.counts[rule] += 1
        self.metrics |= {f"health/alarm_{rule}": float(rule in self.firing) for rule in RULES}
        return alarms

    def _nonfinite(self, metrics: dict[str, Any], step: int, reason: str | None) -> Alarm | None:
        if not metrics.get("skipped_step"):
            return None
        return Alarm("nonfinite", step, step - 2, f"the step was skipped for a {reason or 'non-finite value'}")

    def _dead(self, metrics: dict[str, Any], step: int) -> Alarm | None:
        c = self.config
        entropy = 0.0 - metrics["response/logprob_mean"] if _finite(metrics.get("response/logprob_mean")) else None
        grad = metrics.get("grad_norm")
        if entropy is not None:
            self.metrics["health/entropy"] = entropy
        dead = entropy is not None and entropy < c.dead_entropy and _finite(grad) and grad < c.dead_grad_norm
        self.dead_streak = self.dead_streak + 1 if dead else 0
        if self.dead_streak < c.dead_steps:
            return None
        return Alarm("dead_policy", step, step - self.dead_streak - 1,
                     f"sampled-token entropy {entropy:.2g} < {c.dead_entropy:g} and gradient norm {grad:.2g} < "
                     f"{c.dead_grad_norm:g} for {self.dead_streak} steps: the policy has turned deterministic")

    def _windowed(self, metrics: dict[str, Any], step: int) -> list[Alarm | None]:
        """The ESS and reward rules: vcpo.study.detector.Rule, the offline detector's code."""
        c, ess, reward = self.config, self.ess, self.reward
        ess_warns, reward_warns = ess.update(metrics), reward.update(metrics)
        self.metrics |= {f"health/{key}_mean": ess.means[key] for key in ("ess", "grad_norm") if key in ess.means}
        self.metrics |= {f"health/{key}": reward.means[key] for key in ("reward", "reward_best") if key in reward.means}
        alarms: list[Alarm | None] = []
        if reward_warns:
            alarms.append(Alarm("reward_collapse", step, step - 2, f"training reward's {c.reward_smooth}-step mean "
                                f"{reward.means['reward']:.3f} < {1 - c.reward_drop:g} x its best "
                                f"{reward.means['reward_best']:.3f}"))
        if ess_warns:
            gate = "" if c.ess_grad_below is None else (f" and the gradient norm's {c.grad_smooth}-step mean "
                                                        f"{ess.means['grad_norm']:.3g} < {c.ess_grad_below:g}")
            alarms.append(Alarm("ess", step, step - 2, f"ESS ratio's {c.ess_smooth}-step mean {ess.means['ess']:.3f} < "
                                f"{c.ess_below:g}{gate}"))
        return alarms

    def _accuracy(self, metrics: dict[str, Any], step: int) -> Alarm | None:
        initial, acc = metrics.get("eval/accuracy_initial"), metrics.get("eval/accuracy")
        if _finite(initial):  # the evaluation before RL, on step 1's line
            self.best_accuracy = max(self.best_accuracy or 0.0, initial)
        if not _finite(acc):
            return None
        c, best, n = self.config, self.best_accuracy, metrics.get("eval/problems")
        noise = 2 * math.sqrt(best * (1 - best) / n) if best is not None and _finite(n) and n > 0 else 0.0
        low = best is not None and acc < c.accuracy_fall * best and best - acc > noise
        self.low_evals = self.low_evals + 1 if low else 0
        if not low:
            self.good_eval = step
        self.best_accuracy = acc if best is None else max(best, acc)
        self.metrics["health/accuracy_best"] = self.best_accuracy
        if self.low_evals < c.accuracy_evals:
            return None
        return Alarm("accuracy_fall", step, self.good_eval, f"held-out accuracy {acc:.3f} < {c.accuracy_fall:g} x "
                     f"its best {best:.3f} at {self.low_evals} evaluations in a row")

    def summary(self) -> dict[str, Any]:
        """What summary.json reports: alarmed steps per rule, and with rollbacks, their count and the lr factor."""
        return {"alarms": dict(self.counts), "rollbacks": self.rollbacks, "lr_factor": self.lr_factor}


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
