"""What went wrong without stopping a run, counted over all its steps (and across resumes): skipped
non-finite steps, dropped rollout groups, reward errors and timeouts, rollout-worker restarts.

``summary.json`` and the command's last line report them, so that no failure is silent (with the health alarms'
counts, vcpo.loop.alarms).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

DROP_METRICS = ("staleness/dropped_over_bound", "staleness/dropped_alpha")
RESTART_METRIC = "async/worker_restarts"


@dataclass
class RunHealth:
    """Running totals; ``record`` takes each step's metrics. Skips, reward errors and timeouts are per-step
    metrics summed here; drops and restarts are the rollout source's own running totals (also kept in
    its checkpointed state), read at the end."""

    skipped_steps: int = 0
    consecutive_skipped: int = 0
    reward_errors: int = 0
    reward_timeouts: int = 0

    def record(self, metrics: dict[str, Any]) -> None:
        skipped = bool(metrics.get("skipped_step"))
        self.skipped_steps += skipped
        self.consecutive_skipped = self.consecutive_skipped + 1 if skipped else 0
        self.reward_errors += _count(metrics.get("reward/errors"))
        self.reward_timeouts += _count(metrics.get("reward/timeouts"))

    def state(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> RunHealth:
        return cls(**{k: int(v) for k, v in (state or {}).items() if k in cls.__dataclass_fields__})

    def counts(self, source_metrics: dict[str, float]) -> dict[str, int]:
        """The totals ``summary.json`` reports."""
        return {
            "skipped_steps": self.skipped_steps,
            "dropped_groups": sum(_count(source_metrics.get(key)) for key in DROP_METRICS),
            "reward_errors": self.reward_errors,
            "reward_timeouts": self.reward_timeouts,
            "worker_restarts": _count(source_metrics.get(RESTART_METRIC)),
        }


def _count(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and math.isfinite(value) else 0


def describe(summary: dict[str, Any]) -> str:
    """The command's last line: accuracy before and after, then every count of things that went wrong (health
    alarms: steps on which each rule fired, and rollbacks when there were any)."""
    s = summary
    fired = {rule: n for rule, n in s.get("alarms", {}).items() if n}
    alarms = f"health alarms {sum(fired.values())}" + (
        f" ({', '.join(f'{rule} {n}' for rule, n in fired.items())})" if fired else "")
    if s.get("rollbacks"):
        alarms += f", rollbacks {s['rollbacks']} (learning rate x{s['lr_factor']:g})"
    return (
        f"{accuracy_change(s)} ({s['wall_time_s']:.0f} s){_verdict(s)}; skipped steps {s['skipped_steps']}, "
        f"dropped groups {s['dropped_groups']}, reward errors {s['reward_errors']} (timeouts {s['reward_timeouts']}), "
        f"worker restarts {s['worker_restarts']}, {alarms}; run: {s['run_dir']}"
    )


def accuracy_change(summary: dict[str, Any]) -> str:
    """``held-out accuracy: A before RL -> B after N steps``."""
    final = summary.get("final_accuracy")
    after = f"{final:.3f}" if isinstance(final, float) else "n/a"
    return f"held-out accuracy: {summary['initial_accuracy']:.3f} before RL -> {after} after {summary['steps']} steps"


def ended(summary: dict[str, Any]) -> str:
    """What a stopped run's last line adds: its accuracy change and whether it is beyond noise."""
    if not isinstance(summary.get("initial_accuracy"), float):
        return ""
    return f"; {accuracy_change(summary)}{_verdict(summary)}"


def _verdict(summary: dict[str, Any]) -> str:
    """How the final accuracy compares with the one before RL, beyond noise or not (``accuracy_verdict``)."""
    verdict = summary.get("verdict")
    if verdict not in ("worse", "better", "unchanged"):
        return ""
    change, noise = summary["accuracy_change"], summary["accuracy_noise"]
    if verdict == "worse":
        return f", WORSE than before RL beyond noise ({change:+.3f}, noise {noise:.3f})"
    if verdict == "better":
        return f", better than before RL beyond noise ({change:+.3f}, noise {noise:.3f})"
    return f", within noise of it ({change:+.3f}, noise {noise:.3f})"
