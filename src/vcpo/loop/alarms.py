"""Live health alarms: rules computed from each step's metrics line (and its evaluation), in every mode and backend,
since every run goes through the same loop (docs/trainer.md, health alarms).

Rules, with the thresholds of ``trainer.health`` (h):
- ``nonfinite``: the learner skipped the step (a non-finite loss, ESS, gradient norm or sampled log-prob).
- ``dead_policy``: for ``h.dead_steps`` steps in a row, the mean negative log-prob of the sampled tokens,
  ``-E[log pi_behavior(y_t)]`` (a Monte-Carlo estimate of the per-token entropy), is below ``h.dead_entropy`` and
  the gradient norm is finite and below ``h.dead_grad_norm``, on steps that are not saturated (below): the policy
  samples one answer, not the right one everywhere, and learns nothing.
- ``uniform_policy``: for ``h.uniform_steps`` steps in a row, that entropy estimate is at least ``h.uniform_frac`` x
  ln(vocabulary size) (a uniform policy's entropy) after the run has been below that level (a fresh model at a high
  temperature starts there, and is judged once it has left it), or above the first step's by more than
  ``h.entropy_rise`` nats: the policy has blown up into noise (a learning rate far too high turns it uniform on some
  CPUs, NaN on others).
- ``no_signal``: for ``h.no_signal_steps`` steps in a row, every group's rewards are equal
  (``reward/zero_var_group_frac`` = 1, so every advantage is 0) and the gradient norm is below ``h.dead_grad_norm``,
  on steps that are not saturated.
- ``reward_collapse``: the training reward's ``h.reward_smooth``-step mean is below ``(1 - h.reward_drop)`` x its
  best such mean so far, once that best is at least ``h.reward_floor`` (from step ``h.warmup``); or, from the first
  steps on, the mean of the last ``h.reward_fall_window`` steps is below ``(1 - h.reward_drop)`` x the first step's
  reward (once that is at least ``h.reward_floor``) and below it by more than two standard errors (each step's
  ``reward/std`` over the square root of its number of groups, ``batch/groups``: a conservative bound, since a
  group's rewards share a prompt), until the smoothed rule's window is full.
- ``ess``: the ESS ratio's ``h.ess_smooth``-step mean is below ``h.ess_below`` while the gradient norm's
  ``h.grad_smooth``-step mean is below ``h.ess_grad_below``: the early-warning rule tuned offline
  (vcpo.loop.rules.ESS_ALARM, the same code); a low ESS alone does not fire it (full-VCPO runs sit there).
- ``accuracy_fall``: held-out accuracy is below ``h.accuracy_fall`` x its best so far (the evaluation before RL
  included), and below it by more than two binomial standard errors of that best, ``2 sqrt(b (1 - b) / n)`` over
  the n evaluation problems (1 of 16 problems right, then none, is noise), at ``h.accuracy_evals`` evaluations in a
  row, or at the run's final evaluation alone.
The smoothed ``reward_collapse`` and ``ess`` fire from step ``h.warmup`` on.

Saturation is not an alarm: a step whose every reward equals ``h.max_reward`` (every group solved: no advantage, a
vanishing gradient, and often a low entropy, as in a dead policy) is logged as ``health/saturated`` = 1; after
``h.no_signal_steps`` such steps in a row the console says so once (a notice, ``notices``), and ``trainer.on_alarm``
does not act on it. Dynamic sampling (``rollout.filter: zero_variance``) answers it by training on unsolved prompts
while there are any.

Apart from the rules, :func:`accuracy_verdict` says whether a run ended worse than it started beyond noise.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

from vcpo.config import HealthConfig
from vcpo.loop.rules import Rule

RULES = ("nonfinite", "dead_policy", "uniform_policy", "no_signal", "reward_collapse", "ess", "accuracy_fall")


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
    have seen: rewound by a rollback) and ``totals`` (alarm counts, rollbacks, the learning-rate factor: kept).
    ``vocab_size``: the policy's number of logits (None: ``uniform_policy`` judges the rise alone)."""

    def __init__(self, config: HealthConfig, state: dict[str, Any] | None = None,
                 vocab_size: int | None = None) -> None:
        self.config = config
        c = config
        self.uniform_entropy = c.uniform_frac * math.log(vocab_size) if vocab_size and vocab_size > 1 else None
        self.notices: list[str] = []
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
        self.uniform_streak = int(windows.get("uniform_streak", 0))
        self.silent_streak = int(windows.get("silent_streak", 0))
        self.saturated_streak = int(windows.get("saturated_streak", 0))
        self.entropy_start: float | None = windows.get("entropy_start")
        self.entropy_low: float | None = windows.get("entropy_low", self.entropy_start)  # the lowest so far
        self.reward_start: list[float] | None = windows.get("reward_start")  # [mean, standard error] of the first step
        self.recent_rewards: deque[list[float]] = deque(windows.get("recent_rewards", []),
                                                        maxlen=self.config.reward_fall_window)
        self.low_evals = int(windows.get("low_evals", 0))
        best = windows.get("best_accuracy")
        self.best_accuracy: float | None = None if best is None else float(best)
        self.good_eval = int(windows.get("good_eval", 0))
        self.firing: set[str] = set(windows.get("firing", []))

    def state(self) -> dict[str, Any]:
        return {
            "windows": {"ess": self.ess.state(), "reward": self.reward.state(), "dead_streak": self.dead_streak,
                        "uniform_streak": self.uniform_streak, "silent_streak": self.silent_streak,
                        "saturated_streak": self.saturated_streak, "entropy_start": self.entropy_start,
                        "entropy_low": self.entropy_low, "reward_start": self.reward_start,
                        "recent_rewards": [list(r) for r in self.recent_rewards],
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

    def observe(self, metrics: dict[str, Any], skip_reason: str | None = None, final: bool = False) -> list[Alarm]:
        """The alarms a finished step raises (each enabled rule's), given its metrics line; ``repeat`` marks a rule
        that fired on the step before too (the console says so once). ``final``: the run's last step. The step's
        notices (lines no ``trainer.on_alarm`` acts on) are left in ``notices``."""
        step = int(metrics["step"])
        self.metrics, self.notices = {}, []
        entropy = 0.0 - metrics["response/logprob_mean"] if _finite(metrics.get("response/logprob_mean")) else None
        if entropy is not None:
            self.metrics["health/entropy"] = entropy
        saturated = self._saturated(metrics, step)
        found = [self._nonfinite(metrics, step, skip_reason), self._dead(metrics, step, entropy, saturated),
                 self._uniform(metrics, step, entropy), self._silent(metrics, step, saturated),
                 self._reward_fall(metrics, step),
                 *self._windowed(metrics, step), self._accuracy(metrics, step, final)]
        found = [a for a in found if a is not None and a.rule not in self.config.disabled]
        alarms = [replace(a, repeat=a.rule in self.firing) for a in _one_per_rule(found)]
        self.firing = {a.rule for a in alarms}
        for rule in self.firing:
            self.counts[rule] += 1
        self.metrics |= {f"health/alarm_{rule}": float(rule in self.firing) for rule in RULES}
        return alarms

    def _streak(self, name: str, holds: bool) -> int:
        """Steps in a row a rule's condition has held, this one included (0 when it does not)."""
        setattr(self, name, getattr(self, name) + 1 if holds else 0)
        return getattr(self, name)

    def _nonfinite(self, metrics: dict[str, Any], step: int, reason: str | None) -> Alarm | None:
        if not metrics.get("skipped_step"):
            return None
        return Alarm("nonfinite", step, step - 2, f"the step was skipped for a {reason or 'non-finite value'}")

    def _saturated(self, metrics: dict[str, Any], step: int) -> bool:
        """Every reward of the step at ``max_reward`` (every group tied at the top, none with a wrong answer): the
        run has solved these prompts. Logged as ``health/saturated``; a notice after ``no_signal_steps`` in a row."""
        c = self.config
        zero_var, reward, std = (metrics.get(k) for k in ("reward/zero_var_group_frac", "reward/mean", "reward/std"))
        saturated = (_finite(zero_var) and zero_var >= 1.0 and _finite(reward) and reward >= c.max_reward
                     and _finite(std) and std == 0.0)
        self.metrics["health/saturated"] = float(saturated)
        if self._streak("saturated_streak", saturated) == c.no_signal_steps:
            self.notices.append(
                f"health notice at step {step}: saturated: every reward was the maximum ({c.max_reward:g}) for "
                f"{self.saturated_streak} steps: the run has solved its training prompts and learns nothing more from "
                f"them (not an alarm: trainer.on_alarm does not act on it; harder prompts, or rollout.filter="
                f"zero_variance to train on the unsolved ones while any are left)")
        return saturated

    def _dead(self, metrics: dict[str, Any], step: int, entropy: float | None, saturated: bool) -> Alarm | None:
        c = self.config
        grad = metrics.get("grad_norm")
        dead = (entropy is not None and entropy < c.dead_entropy and _finite(grad) and grad < c.dead_grad_norm
                and not saturated)
        if self._streak("dead_streak", dead) < c.dead_steps:
            return None
        return Alarm("dead_policy", step, step - self.dead_streak - 1,
                     f"sampled-token entropy {entropy:.2g} < {c.dead_entropy:g} and gradient norm {grad:.2g} < "
                     f"{c.dead_grad_norm:g} for {self.dead_streak} steps: the policy has turned deterministic")

    def _uniform(self, metrics: dict[str, Any], step: int, entropy: float | None) -> Alarm | None:
        """Sampled-token entropy near a uniform policy's after the policy's own level (``_policy_entropy``, which a
        sampler that ignores the policy does not share) has been below it, or far above the first step's."""
        c = self.config
        if entropy is None:
            return None
        policy_entropy = _policy_entropy(metrics, entropy)
        if self.entropy_start is None:
            self.entropy_start = entropy
        # a policy that starts near uniform (a fresh model, a high temperature) has not blown up into noise: the
        # level counts once the policy has been below it
        self.entropy_low = policy_entropy if self.entropy_low is None else min(self.entropy_low, policy_entropy)
        near_uniform = (self.uniform_entropy is not None and entropy >= self.uniform_entropy
                        and self.entropy_low < self.uniform_entropy)
        risen = entropy - self.entropy_start > c.entropy_rise
        if self._streak("uniform_streak", near_uniform or risen) < c.uniform_steps:
            return None
        of_uniform = (f" ({entropy / (self.uniform_entropy / c.uniform_frac):.0%} of a uniform policy's)"
                      if self.uniform_entropy is not None else "")
        return Alarm("uniform_policy", step, step - self.uniform_streak - 1,
                     f"sampled-token entropy {entropy:.3g} nats{of_uniform} against {self.entropy_start:.3g} at the "
                     f"first step, for {self.uniform_streak} steps: the policy has turned (near) uniform, it samples "
                     f"noise")

    def _silent(self, metrics: dict[str, Any], step: int, saturated: bool) -> Alarm | None:
        """Every group's rewards equal and no gradient, short of every one at the maximum: the run learns nothing."""
        c = self.config
        zero_var, grad = metrics.get("reward/zero_var_group_frac"), metrics.get("grad_norm")
        silent = (_finite(zero_var) and zero_var >= 1.0 and _finite(grad) and grad < c.dead_grad_norm
                  and not saturated)
        if self._streak("silent_streak", silent) < c.no_signal_steps:
            return None
        return Alarm("no_signal", step, step - self.silent_streak - 1,
                     f"every group's rewards were equal (mean reward {metrics.get('reward/mean', math.nan):.3g}) and "
                     f"the gradient norm {grad:.2g} < {c.dead_grad_norm:g} for {self.silent_streak} steps: no "
                     f"learning signal")

    def _reward_fall(self, metrics: dict[str, Any], step: int) -> Alarm | None:
        """The training reward of the last steps against the first step's, beyond two standard errors."""
        c = self.config
        reward = metrics.get("reward/mean")
        if not _finite(reward):
            return None
        # a conservative standard error of the step's mean: each group counts as one sample (a group's rewards share
        # a prompt, so they are correlated; the variance of a group's mean is at most that of one reward)
        std, n = metrics.get("reward/std"), metrics.get("batch/groups", metrics.get("batch/size"))
        se = std / math.sqrt(n) if _finite(std) and _finite(n) and n > 0 else 0.0
        if self.reward_start is None:
            self.reward_start = [float(reward), se]
            return None
        self.recent_rewards.append([float(reward), se])
        if len(self.recent_rewards) < c.reward_fall_window or step > max(c.warmup, c.reward_smooth):
            return None  # the smoothed rule's window is full from then on: it judges the rest of the run
        (start, start_se), w = self.reward_start, c.reward_fall_window
        recent = math.fsum(r for r, _ in self.recent_rewards) / w
        noise = 2 * math.sqrt(start_se**2 + math.fsum(e**2 for _, e in self.recent_rewards) / w**2)
        if not (start >= c.reward_floor and recent < (1 - c.reward_drop) * start and start - recent > noise):
            return None
        return Alarm("reward_collapse", step, step - w - 1,
                     f"training reward's mean over the last {w} steps {recent:.3f} < {1 - c.reward_drop:g} x the "
                     f"first step's {start:.3f} (beyond two standard errors, {noise:.3f})")

    def _windowed(self, metrics: dict[str, Any], step: int) -> list[Alarm | None]:
        """The ESS and reward rules: vcpo.loop.rules.Rule, the offline detector's code."""
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

    def _accuracy(self, metrics: dict[str, Any], step: int, final: bool) -> Alarm | None:
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
        if self.low_evals < c.accuracy_evals and not (final and low):
            return None
        when = "at the final evaluation" if self.low_evals < c.accuracy_evals else (
            f"at {self.low_evals} evaluations in a row")
        return Alarm("accuracy_fall", step, self.good_eval, f"held-out accuracy {acc:.3f} < {c.accuracy_fall:g} x "
                     f"its best {best:.3f} (beyond two standard errors, {noise:.3f}) {when}")

    def summary(self) -> dict[str, Any]:
        """What summary.json reports: alarmed steps per rule, and with rollbacks, their count and the lr factor."""
        return {"alarms": dict(self.counts), "rollbacks": self.rollbacks, "lr_factor": self.lr_factor}


def accuracy_verdict(initial: float | None, final: float | None, problems: int) -> dict[str, Any]:
    """Whether a run ended better or worse than it started, beyond noise: the change in held-out accuracy against
    two standard errors of the difference of two proportions over the same ``problems``,
    ``2 sqrt((p0 (1 - p0) + p1 (1 - p1)) / n)`` (a conservative bound: the same problems make the two correlated).
    ``verdict``: ``worse``, ``better``, ``unchanged`` (within noise) or ``unknown`` (no evaluation)."""
    if not (_finite(initial) and _finite(final)) or problems <= 0:
        return {"verdict": "unknown"}
    noise = 2 * math.sqrt((initial * (1 - initial) + final * (1 - final)) / problems)
    change = final - initial
    verdict = "worse" if change < -noise else "better" if change > noise else "unchanged"
    return {"verdict": verdict, "accuracy_change": change, "accuracy_noise": noise}


SAMPLER_AGREES = 0.5
"""The mean |log pi_learner - log pi_behavior| (nats per token, ``mismatch/logprob_abs_mean``) below which the sampled
tokens' entropy estimate is taken as the policy's own: kernel and precision gaps are orders of magnitude smaller; a
sampler that ignores the policy is off by about the gap between ln V and the policy's log-probs (nats)."""


def _policy_entropy(metrics: dict[str, Any], sampled: float) -> float:
    """The policy's own per-token entropy at the rollout temperature: the learner's exact ``entropy/mean`` when it
    computes one; else ``sampled`` (the sampled tokens' estimate) when the learner's log-probs of those tokens agree
    with the sampler's (or no token was sampled at the learner's weights: nothing says they differ); else 0 (the
    sampler does not draw from the policy, whose level is then unknown: taken as not near uniform)."""
    exact, gap = metrics.get("entropy/mean"), metrics.get("mismatch/logprob_abs_mean")
    if _finite(exact):
        return float(exact)
    return sampled if not _finite(gap) or gap < SAMPLER_AGREES else 0.0


def _one_per_rule(alarms: list[Alarm]) -> list[Alarm]:
    """The first alarm of each rule (reward_collapse has two arms), in the order found."""
    seen: dict[str, Alarm] = {}
    for alarm in alarms:
        seen.setdefault(alarm.rule, alarm)
    return list(seen.values())


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
