"""What "collapse" means for a run, an online early-warning detector fed one metrics line at a time, and
how well its warnings predict collapse across a sweep (lead time, false alarms, misses).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

COLLAPSE_FRACTION = 0.5
"""A run collapses when held-out accuracy falls below this fraction of its best so far and stays there."""


def collapse_point(
    eval_steps: list[int], eval_acc: list[float], frac: float = COLLAPSE_FRACTION
) -> int | None:
    """The step at which a run collapsed, or None if it did not.

    Definition (the only one used in this project): with ``best(s)`` the highest held-out accuracy at any
    evaluation up to and including step ``s`` (the evaluation before RL counts, as step 0), a run has
    collapsed at the first evaluation step ``s`` with ``acc(s) < frac * best(s)`` such that every later
    evaluation also stays below ``frac * best(s)``. A dip that recovers is not a collapse; a run whose
    best accuracy is 0 cannot collapse (there is nothing to lose). Evaluations must be in step order.
    """
    if len(eval_steps) != len(eval_acc):
        raise ValueError(f"eval_steps ({len(eval_steps)}) and eval_acc ({len(eval_acc)}) differ in length")
    best = -math.inf
    for i, (step, acc) in enumerate(zip(eval_steps, eval_acc, strict=True)):
        best = max(best, acc)
        level = frac * best
        if best > 0 and acc < level and all(later < level for later in eval_acc[i + 1:]):
            return step
    return None


def eval_series(records: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """(steps, accuracies) of a run's held-out evaluations, the one before RL first (as step 0)."""
    steps: list[int] = []
    accs: list[float] = []
    for record in records:
        initial = record.get("eval/accuracy_initial")
        if isinstance(initial, int | float) and not steps:
            steps.append(0)
            accs.append(float(initial))
        acc = record.get("eval/accuracy")
        if isinstance(acc, int | float):
            steps.append(int(record["step"]))
            accs.append(float(acc))
    return steps, accs


@dataclass
class EarlyWarning:
    """Online collapse warning from the ESS ratio and the gradient norm (ALGORITHMS.md §10).

    At each step:
    - ESS fall: the mean ESS ratio of the last ``smooth`` steps is below ``ess_drop`` x the median of the
      ``window`` steps before them, or below ``ess_floor``;
    - gradient instability: ``grad_norm > grad_spike * median`` of the previous ``window`` steps, or a
      non-finite gradient norm (the learner skipped the step).
    A step warns when either holds. Relative tests compare against the run's own recent past (so a steady low
    ESS, large k from the start, does not fire) and wait for a full window of history. The thresholds come
    from the VCPO paper's description ("a sharp ESS drop", a "gradient-norm spike"), not tuned per run.
    Revised once, after the study's first (seed-0) cells: with only 5 steps of history and the raw per-step
    ESS ratio (which swings between 0.2 and 0.8 from one batch of 128 to the next), it fired within the first
    15 steps of every stale run, while the lag ramps up. The report evaluates it on the other seeds apart.
    """

    window: int = 20
    smooth: int = 5
    ess_drop: float = 0.5
    ess_floor: float = 0.05
    grad_spike: float = 5.0
    warning_steps: list[int] = field(default_factory=list)
    _ess: deque[float] = field(default_factory=deque, repr=False)
    _grad: deque[float] = field(default_factory=deque, repr=False)

    def update(self, record: dict[str, Any]) -> bool:
        """Feed one metrics line (needs ``step``; uses ``ess/ratio`` and ``grad_norm``); True if it warns."""
        ess, grad = record.get("ess/ratio"), record.get("grad_norm")
        warn = False
        if isinstance(ess, int | float) and math.isfinite(ess):
            self._push(self._ess, float(ess), self.window + self.smooth)
            if len(self._ess) >= self.smooth:
                values = list(self._ess)
                recent = statistics.fmean(values[-self.smooth:])
                warn |= recent < self.ess_floor
                if len(values) == self.window + self.smooth:
                    warn |= recent < self.ess_drop * statistics.median(values[:self.window])
        if grad is None or not math.isfinite(grad):
            warn = True
        else:
            if len(self._grad) == self.window:
                warn |= grad > self.grad_spike * statistics.median(self._grad)
            self._push(self._grad, float(grad), self.window)
        if warn:
            self.warning_steps.append(int(record["step"]))
        return warn

    @staticmethod
    def _push(history: deque[float], value: float, size: int) -> None:
        history.append(value)
        if len(history) > size:
            history.popleft()


def warning_steps(records: list[dict[str, Any]], detector: EarlyWarning | None = None) -> list[int]:
    """Every step at which a fresh detector (default parameters unless given) warns over a run's metrics."""
    detector = detector or EarlyWarning()
    for record in records:
        detector.update(record)
    return list(detector.warning_steps)


def evaluate_warnings(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """How well warnings predicted collapse. Each cell needs ``collapse_step`` (int or None) and ``warning_steps``.

    A collapsed cell is a hit when some warning came at or before its collapse step (lead time = collapse
    step - first such warning step, in optimizer steps), else a miss. A cell that never collapsed but warned
    is a false alarm; one that never collapsed nor warned is a true quiet.
    """
    leads: list[int] = []
    misses = false_alarms = quiet = 0
    for cell in cells:
        collapse, warnings = cell["collapse_step"], cell["warning_steps"]
        if collapse is None:
            false_alarms += bool(warnings)
            quiet += not warnings
            continue
        before = [w for w in warnings if w <= collapse]
        if before:
            leads.append(collapse - min(before))
        else:
            misses += 1
    collapsed = len(leads) + misses
    return {
        "cells": len(cells), "collapsed": collapsed, "hits": len(leads), "misses": misses,
        "false_alarms": false_alarms, "quiet": quiet, "lead_steps": leads,
        "median_lead_steps": statistics.median(leads) if leads else None,
        "recall": len(leads) / collapsed if collapsed else None,
        "false_alarm_rate": false_alarms / (false_alarms + quiet) if false_alarms + quiet else None,
    }
