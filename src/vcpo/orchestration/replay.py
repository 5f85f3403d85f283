"""TBA's replay buffer as a rollout source: whole GRPO groups from any inner source are kept, evicted
by age (policy lag), use count and capacity, and each step trains on TBA's mix of the newest groups
and reward-prioritised older ones (Bartoldson et al. 2025, arXiv 2503.18929; ALGORITHMS.md §7).

The unit is the GRPO group, never a single trajectory: advantages (GRPO, RLOO, OPOB) and TB's
VarGrad log Z are computed within a group, so a group is sampled, reused and evicted whole and its
members stay together with the group id they were generated under.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import torch

from vcpo.orchestration.base import RolloutSource, trajectory_from_dict, trajectory_to_dict
from vcpo.types import Trajectory


@dataclass(eq=False)  # entries compare and hash by identity: two equal groups are still two entries
class ReplayEntry:
    """One buffered GRPO group: its trajectories untouched (behavior log-probs and versions as
    generated), when it entered (``seq``, an insertion counter) and how often it was trained on."""

    group: list[Trajectory]
    seq: int
    uses: int = 0

    @property
    def oldest_version(self) -> int:
        """The policy version of the group's oldest token: its lag bounds every token's lag."""
        return min(t.min_version for t in self.group)

    @property
    def mean_reward(self) -> float:
        return sum(t.reward for t in self.group) / len(self.group)

    def age(self, learner_version: int) -> int:
        return learner_version - self.oldest_version


class ReplayBuffer:
    """Buffered groups, TBA's sampling, and eviction that keeps every sampled token's lag <= max_age.

    Per step (``add`` then ``draw``), with n groups to draw:
    1. Evict every group whose oldest token's lag ``learner_version - version`` exceeds ``max_age``
       (the run's staleness bound k), then the oldest groups (by version, then arrival) beyond
       ``capacity``.
    2. ``recent_fraction * n`` groups (rounded half up) are drawn uniformly without replacement from
       the groups that arrived this step ("most recent", TBA's recency sampling), the rest from the
       older groups without replacement with probability proportional to
       ``exp(priority_inv_temp * mean reward)`` (TBA's reward-prioritised softmax; 0 = uniform).
       Either side short of groups is topped up from the other, so a batch is smaller than n only
       when the whole buffer is.
    3. Every drawn group's use count rises by one; a group used ``max_uses`` times is evicted.
    """

    def __init__(self, capacity: int, recent_fraction: float, priority_inv_temp: float, max_uses: int,
                 max_age: int, seed: int) -> None:
        if capacity < 1 or max_uses < 1 or max_age < 0 or priority_inv_temp < 0 or not 0 <= recent_fraction <= 1:
            raise ValueError("need capacity >= 1, max_uses >= 1, max_age >= 0, priority_inv_temp >= 0 and "
                             f"0 <= recent_fraction <= 1; got {capacity}, {max_uses}, {max_age}, "
                             f"{priority_inv_temp}, {recent_fraction}")
        self.capacity = capacity
        self.recent_fraction = recent_fraction
        self.priority_inv_temp = priority_inv_temp
        self.max_uses = max_uses
        self.max_age = max_age
        self.rng = random.Random(seed)
        self.entries: list[ReplayEntry] = []
        self.next_seq = 0

    def add(self, groups: list[list[Trajectory]]) -> list[ReplayEntry]:
        """Buffer freshly generated groups; returns their entries (this step's "recent" groups)."""
        fresh = [ReplayEntry(group, self.next_seq + i) for i, group in enumerate(groups)]
        self.next_seq += len(fresh)
        self.entries.extend(fresh)
        return fresh

    def draw(self, fresh: list[ReplayEntry], n_groups: int,
             learner_version: int) -> tuple[list[ReplayEntry], dict[str, float]]:
        """Steps 1-3 above: the groups to train on at ``learner_version`` and the ``replay/*`` metrics."""
        evicted = self._evict(learner_version)
        live = set(self.entries)
        recent = [e for e in fresh if e in live]
        recent_set = set(recent)
        older = [e for e in self.entries if e not in recent_set]
        n_recent = min(math.floor(self.recent_fraction * n_groups + 0.5), len(recent))
        n_older = min(n_groups - n_recent, len(older))
        n_recent = min(n_groups - n_older, len(recent))
        picked = self.rng.sample(recent, n_recent) + self._prioritised(older, n_older)
        for e in picked:
            e.uses += 1
        spent = {e for e in picked if e.uses >= self.max_uses}
        self.entries = [e for e in self.entries if e not in spent]
        uses = [e.uses for e in picked]
        ages = [e.age(learner_version) for e in picked]
        return picked, {
            "replay/buffer_groups": float(len(self.entries)),
            "replay/recent_frac": n_recent / len(picked) if picked else 0.0,
            "replay/uses_mean": sum(uses) / len(uses) if uses else 0.0,
            "replay/uses_max": float(max(uses, default=0)),
            "replay/age_min": float(min(ages, default=0)),
            "replay/age_mean": sum(ages) / len(ages) if ages else 0.0,
            "replay/age_max": float(max(ages, default=0)),
            "replay/max_age": float(self.max_age),
            "replay/evicted_uses": float(len(spent)),
        } | evicted

    def _evict(self, learner_version: int) -> dict[str, float]:
        """Step 1: drop the groups older than ``max_age``, then the oldest beyond ``capacity``."""
        too_old = [e for e in self.entries if e.age(learner_version) > self.max_age]
        kept = [e for e in self.entries if e.age(learner_version) <= self.max_age]
        overflow = sorted(kept, key=lambda e: (e.oldest_version, e.seq))[:max(len(kept) - self.capacity, 0)]
        gone = set(too_old) | set(overflow)
        self.entries = [e for e in kept if e not in gone]
        return {"replay/evicted_age": float(len(too_old)), "replay/evicted_capacity": float(len(overflow)),
                "replay/evicted_unused": float(sum(e.uses == 0 for e in gone))}

    def _prioritised(self, pool: list[ReplayEntry], n: int) -> list[ReplayEntry]:
        """``n`` entries without replacement, each draw with probability ``∝ exp(beta * mean reward)``
        among those left (the exponent shifted by its maximum, so any reward scale is finite)."""
        pool = list(pool)
        picked = []
        for _ in range(n):
            logits = [self.priority_inv_temp * e.mean_reward for e in pool]
            top = max(logits)
            weights = [math.exp(z - top) for z in logits]
            u = self.rng.random() * sum(weights)
            i, acc = 0, weights[0]
            while acc <= u and i + 1 < len(pool):
                i += 1
                acc += weights[i]
            picked.append(pool.pop(i))
        return picked

    def state(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {
            "entries": [{"seq": e.seq, "uses": e.uses, "group": [trajectory_to_dict(t) for t in e.group]}
                        for e in self.entries],
            "next_seq": self.next_seq,
            "rng": [version, list(internal), gauss],
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.entries = [ReplayEntry([trajectory_from_dict(d) for d in e["group"]], int(e["seq"]), int(e["uses"]))
                        for e in state["entries"]]
        self.next_seq = int(state["next_seq"])
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))


def split_groups(trajectories: list[Trajectory]) -> list[list[Trajectory]]:
    """Trajectories grouped by ``group_id``, groups in order of first appearance."""
    groups: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    return list(groups.values())


class ReplaySource:
    """A ``RolloutSource`` that feeds every batch of an inner source into a ``ReplayBuffer`` and
    returns the buffer's draw: the trainer stays mode-blind and sees only trajectories."""

    def __init__(self, inner: RolloutSource, buffer: ReplayBuffer, groups_per_step: int,
                 inner_follows_bound: bool = True) -> None:
        self.inner = inner
        self.buffer = buffer
        self.groups_per_step = groups_per_step
        self.inner_follows_bound = inner_follows_bound
        self._metrics: dict[str, float] = {}

    def next_batch(self, learner_version: int) -> list[Trajectory]:
        fresh_groups = split_groups(self.inner.next_batch(learner_version))
        fresh = self.buffer.add(fresh_groups)
        picked, self._metrics = self.buffer.draw(fresh, self.groups_per_step, learner_version)
        fresh_trajectories = [t for g in fresh_groups for t in g]
        self._metrics |= {
            "replay/fresh_groups": float(len(fresh_groups)),
            "replay/fresh_tokens": float(sum(len(t.response_ids) for t in fresh_trajectories)),
            # reward/mean is of the draw, which the reward priority biases upwards; this is of what was generated.
            "replay/fresh_reward_mean": sum(t.reward for t in fresh_trajectories) / max(len(fresh_trajectories), 1),
        }
        return [t for e in picked for t in e.group]

    def publish(self, model: torch.nn.Module, version: int) -> None:
        self.inner.publish(model, version)

    def set_bound(self, k: int) -> None:
        """k bounds every token trained on: the buffer's age limit, and the inner source's own bound unless that
        runs at a fixed ``async.replay.generation_lag`` (``inner_follows_bound`` False)."""
        self.buffer.max_age = k
        if self.inner_follows_bound:
            self.inner.set_bound(k)

    def metrics(self) -> dict[str, float]:
        return self.inner.metrics() | self._metrics

    def state(self) -> dict[str, Any]:
        return {"inner": self.inner.state(), "buffer": self.buffer.state()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.inner.load_state(state["inner"])
        self.buffer.load_state(state["buffer"])

    def close(self) -> None:
        self.inner.close()
