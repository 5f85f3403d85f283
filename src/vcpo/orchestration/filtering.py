"""Dynamic sampling (DAPO, ``rollout.filter``): which finished groups carry a learning signal, and how one step's
batch is filled with them under the over-generation cap ``rollout.filter_max_factor``, with its ``filter/*``
metrics. Every rollout source (sync, lagged, async, Ray) fills its batches through :class:`StepFill`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from vcpo.orchestration.tally import GroupTally, group_pass_rate
from vcpo.types import Trajectory


def informative(group: list[Trajectory]) -> bool:
    """Whether a group's rewards differ: a group whose rewards r_1..r_G are all equal has every group-relative
    advantage A_i = r_i - mean(r) equal to 0 (DAPO, Yu et al. 2025, eq. 11), so it adds no gradient."""
    rewards_G = [t.reward for t in group]
    return max(rewards_G) != min(rewards_G)


def in_band(group: list[Trajectory], band: tuple[float, float]) -> bool:
    """Whether the group's pass rate (its mean reward) lies in ``band`` = [low, high], ends included."""
    low, high = band
    return low <= group_pass_rate(group) <= high


@dataclass(frozen=True)
class DynamicSampling:
    """``rollout.filter: zero_variance`` with ``rollout.filter_max_factor``, for ``groups_per_step`` groups a step;
    ``pass_rate_band`` (``rollout.filter_pass_rate``) also drops informative groups whose pass rate lies outside it."""

    groups_per_step: int
    max_factor: float
    pass_rate_band: tuple[float, float] = (0.0, 1.0)

    def keeps(self, group: list[Trajectory]) -> bool:
        """Whether a finished group is trained: it has signal and its pass rate lies in the band."""
        return informative(group) and in_band(group, self.pass_rate_band)

    @property
    def cap(self) -> int:
        """The most groups a step judges: floor(max_factor x groups_per_step), at least groups_per_step (the 1e-9
        keeps a product such as 2.3 x 10 = 22.999999999999996 at 23)."""
        return max(self.groups_per_step, math.floor(self.max_factor * self.groups_per_step + 1e-9))

    def fill(self) -> StepFill:
        """A new step's fill."""
        return StepFill(self.groups_per_step, self.cap, self.keeps)


class StepFill:
    """One step's batch under dynamic sampling: finished groups are ``offer``-ed one at a time (in the order they
    arrive) until ``groups_per_step`` informative ones are kept or ``cap`` groups were judged. A step that hits the
    cap trains on what it has: its informative groups, topped up to ``groups_per_step`` with the first
    uninformative ones judged (so the batch keeps its size and is never empty)."""

    def __init__(self, groups_per_step: int, cap: int,
                 keeps: Callable[[list[Trajectory]], bool] = informative) -> None:
        self.P, self.cap, self.keeps = groups_per_step, cap, keeps
        self.kept: list[list[Trajectory]] = []
        self.dropped: list[list[Trajectory]] = []
        self.first_full_s: float | None = None  # when the step had judged its first P groups

    @property
    def judged(self) -> int:
        return len(self.kept) + len(self.dropped)

    @property
    def done(self) -> bool:
        return len(self.kept) >= self.P or self.judged >= self.cap

    @property
    def room(self) -> int:
        """Groups the cap still lets this step judge."""
        return self.cap - self.judged

    def offer(self, group: list[Trajectory]) -> bool:
        """Judge one finished group; True if it is kept (informative, and in the pass-rate band), False if dropped."""
        keep = self.keeps(group)
        (self.kept if keep else self.dropped).append(group)
        if self.judged == self.P:
            self.first_full_s = time.perf_counter()
        return keep

    @property
    def reclaimed(self) -> int:
        """Dropped groups that the batch takes back as fillers (a step that hit the cap judged at least P groups, so
        at least P - kept of them were dropped)."""
        return max(0, self.P - len(self.kept))

    def trained(self) -> list[list[Trajectory]]:
        return self.kept[: self.P] + self.dropped[: self.reclaimed]

    def left_out(self) -> list[list[Trajectory]]:
        """The judged groups the step does not train: those dropped (fillers aside) and a round's surplus."""
        return self.kept[self.P:] + self.dropped[self.reclaimed:]

    def record(self, tally: GroupTally) -> None:
        """Into ``tally``: the groups the step trains, and those it left out as dropped."""
        for group in self.trained():
            tally.add(group, "trained")
        for group in self.left_out():
            tally.add(group, "dropped")

    def result(self) -> tuple[list[list[Trajectory]], dict[str, float]]:
        """The step's groups, the first P informative ones (at the cap: all of them and the first uninformative
        fillers), and its metrics, taken now:
        - ``filter/dropped_frac``: the judged groups' fraction without signal or outside the pass-rate band;
        - ``filter/groups_per_trained``: groups judged per group trained (surplus informative groups of a round count
          as generated, not trained);
        - ``filter/extra_rollout_s``: seconds from the step's first P judged groups to its full batch (what refilling
          cost; 0 when the first P sufficed);
        - ``filter/cap_hit``: 1 when the step trained on fewer than P informative groups."""
        groups = self.trained()
        metrics = {
            "filter/dropped_frac": len(self.dropped) / max(self.judged, 1),
            "filter/groups_per_trained": self.judged / max(len(groups), 1),
            "filter/extra_rollout_s": 0.0 if self.first_full_s is None else time.perf_counter() - self.first_full_s,
            "filter/cap_hit": float(self.reclaimed > 0),
        }
        return groups, metrics
