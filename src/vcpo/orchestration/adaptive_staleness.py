"""Adaptive staleness (``async.max_staleness: auto``): the bound k follows the ESS ratio of the batches trained on.

A pure policy, stepped once per optimizer step with that step's ESS ratio rho_t (``ess/ratio``) and returning the
bound for the next step. It decides once per window of W observations since its last decision (an AIMD rule,
as TCP's congestion window):

    rho_bar = mean of the W ratios of the window
    k <- max(k_min, floor(k * decrease_factor))   if rho_bar <  ess_target   (multiplicative decrease)
    k <- min(k_max, k + increase_step)            if rho_bar >= ess_target   (additive increase)

then starts a new, empty window. A step whose ESS ratio is not finite (a skipped step) is not observed. The
state (k and the window so far) is JSON-able and checkpointed, so a resumed run takes the same decisions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vcpo.config import AsyncConfig


@dataclass(frozen=True)
class AIMDSettings:
    """The policy's constants (``async.auto.*``): bounds, starting bound, target and step sizes."""

    k_min: int
    k_max: int
    k_start: int
    ess_target: float
    window: int
    decrease_factor: float
    increase_step: int

    def __post_init__(self) -> None:
        if not 0 <= self.k_min <= self.k_start <= self.k_max or self.k_min == self.k_max:
            raise ValueError(f"need 0 <= k_min <= k_start <= k_max and k_min < k_max, got {self.k_min}, "
                             f"{self.k_start}, {self.k_max}")
        if self.window < 1 or self.increase_step < 1 or not 0 < self.decrease_factor < 1 or not self.ess_target > 0:
            raise ValueError("need window >= 1, increase_step >= 1, 0 < decrease_factor < 1 and ess_target > 0")


@dataclass
class AdaptiveStaleness:
    """The bound in force (``k``) and the ESS ratios observed in the current window (``window``)."""

    settings: AIMDSettings
    k: int = -1
    window: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.k < 0:
            self.k = self.settings.k_start

    def observe(self, ess_ratio: float | None) -> int:
        """Record one step's ESS ratio; at the end of a window, move k by the rule above. Returns the next k."""
        if ess_ratio is None or not math.isfinite(ess_ratio):
            return self.k
        self.window.append(float(ess_ratio))
        s = self.settings
        if len(self.window) < s.window:
            return self.k
        if sum(self.window) / len(self.window) < s.ess_target:
            return self.lower()
        self.k = min(s.k_max, self.k + s.increase_step)
        self.window = []
        return self.k

    def lower(self) -> int:
        """The multiplicative decrease, ``k <- max(k_min, floor(k * decrease_factor))``, and a new empty window: the
        rule's own step down, and what ``trainer.on_alarm: rollback`` applies. Returns the new k."""
        self.k = max(self.settings.k_min, math.floor(self.k * self.settings.decrease_factor))
        self.window = []
        return self.k

    def state(self) -> dict[str, Any]:
        return {"k": self.k, "window": list(self.window)}

    @classmethod
    def from_state(cls, settings: AIMDSettings, state: dict[str, Any] | None) -> AdaptiveStaleness:
        """A fresh controller at ``k_start``, or one continued from a checkpoint's ``state()``."""
        if not state:
            return cls(settings)
        return cls(settings, k=int(state["k"]), window=[float(x) for x in state["window"]])


def adaptive_staleness(async_config: AsyncConfig, state: dict[str, Any] | None = None) -> AdaptiveStaleness | None:
    """The run's controller when ``async.max_staleness`` is ``auto`` (None for a fixed k), from its
    ``async.auto`` settings and, on resume, the checkpointed ``state``."""
    if not async_config.is_auto:
        return None
    a = async_config.auto
    settings = AIMDSettings(a.k_min, a.k_max, async_config.initial_staleness(), a.ess_target, a.window,
                            a.decrease_factor, a.increase_step)
    return AdaptiveStaleness.from_state(settings, state)
