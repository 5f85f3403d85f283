"""Bounded staleness: admission control for new rollouts and the filters applied at batch time.

The policy lag of a token is ``learner_version - version_that_produced_it``. With bound k, a
rollout group may start only while ``admitted - dropped < (k + version + 1) * groups_per_step``
(AReaL's rule, ALGORITHMS.md §9); at batch time every group is checked again and one whose oldest
token would lag more than k (or more than ROLL Flash's alpha, when set) is dropped, so the bound
holds even when groups finish out of order. The bound may change between steps (``set_bound``). A finished group
that dynamic sampling drops (vcpo.orchestration.filtering) frees its capacity as a dropped stale one does.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from vcpo.types import Trajectory, is_dropped_group


@dataclass
class StalenessStats:
    admitted: int = 0
    dropped_over_bound: int = 0
    dropped_alpha: int = 0
    dropped_agent: int = 0  # groups an agent task dropped (vcpo.agents.collect)
    filtered: int = 0
    """Groups dropped by dynamic sampling (net of those a step took back as fillers at its cap)."""


class StalenessController:
    """Thread-safe admission control and batch-time filtering for one learner."""

    def __init__(self, max_staleness: int, groups_per_step: int, drop_older_than: float | None = None,
                 admit_within_alpha: bool = False) -> None:
        if max_staleness < 0 or groups_per_step <= 0:
            raise ValueError(f"need max_staleness >= 0 and groups_per_step > 0, got {max_staleness}, {groups_per_step}")
        self.k = max_staleness
        self.groups_per_step = groups_per_step
        self.alpha = drop_older_than
        self.admit_within_alpha = admit_within_alpha
        """Admit under min(k, ceil(alpha)) rather than k (``async.batch_order: admission``, where a group's lag is set
        at admission: nothing is generated only to be dropped as older than alpha)."""
        self.stats = StalenessStats()
        self._version = 0
        self._cond = threading.Condition()

    @property
    def version(self) -> int:
        return self._version

    def capacity(self) -> int:
        """How many groups may have been admitted (net of drops) at the current version."""
        k = self.k
        if self.admit_within_alpha and self.alpha is not None:
            k = min(k, math.ceil(self.alpha))
        return (k + self._version + 1) * self.groups_per_step

    def try_admit(self) -> int | None:
        """Admit one new rollout group if the bound allows now; returns the version at admission."""
        return self.wait_admit(timeout_s=0)

    def wait_admit(self, timeout_s: float | None = None) -> int | None:
        """Block until a group may start (or the timeout passes)."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._net() < self.capacity(), timeout=timeout_s)
            if not ok:
                return None
            self.stats.admitted += 1
            return self._version

    def _net(self) -> int:
        s = self.stats
        return s.admitted - s.dropped_over_bound - s.dropped_alpha - s.dropped_agent - s.filtered

    def release(self, groups: int = 1) -> None:
        """``groups`` finished groups left out of the batch by dynamic sampling: their admission capacity is free."""
        with self._cond:
            self.stats.filtered += groups
            self._cond.notify_all()

    def reclaim(self, groups: int) -> None:
        """``groups`` released groups that a step trains after all (fillers at the dynamic-sampling cap)."""
        with self._cond:
            self.stats.filtered -= groups

    def set_bound(self, k: int) -> None:
        """Change k live (``async.max_staleness: auto``): admission uses the new k at once, so lowering it holds new
        groups back until the learner catches up, and the batch-time check drops finished groups beyond it."""
        if k < 0:
            raise ValueError(f"need k >= 0, got {k}")
        with self._cond:
            self.k = k
            self._cond.notify_all()

    def set_version(self, version: int) -> None:
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def keep(self, group: list[Trajectory], learner_version: int) -> bool:
        """Whether a finished group may enter the batch trained at ``learner_version``.

        Drops (and frees admission capacity for) a group whose oldest token lags more than k, or
        whose creation lags more than ceil(alpha) steps when ROLL Flash's alpha is set, or that an agent task dropped.
        """
        oldest = min(t.min_version for t in group)
        lag = learner_version - oldest
        with self._cond:
            if is_dropped_group(group):
                self.stats.dropped_agent += 1
            elif lag > self.k:
                self.stats.dropped_over_bound += 1
            elif self.alpha is not None and lag > math.ceil(self.alpha):
                self.stats.dropped_alpha += 1
            else:
                return True
            self._cond.notify_all()
            return False


def staleness_metrics(trajectories: list[Trajectory], learner_version: int) -> dict[str, float]:
    """Per-token policy lag of a batch's model tokens (not environment observations): ``staleness/{min,mean,max}``
    in optimizer steps."""
    lags = [learner_version - v for t in trajectories for v in t.model_versions()]
    if not lags:
        return {"staleness/min": 0.0, "staleness/mean": 0.0, "staleness/max": 0.0}
    return {
        "staleness/min": float(min(lags)),
        "staleness/mean": float(sum(lags) / len(lags)),
        "staleness/max": float(max(lags)),
    }
