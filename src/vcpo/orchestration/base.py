"""The rollout-source interface, the deterministic problem stream, and what every source shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vcpo.errors import RunFailed
from vcpo.types import Problem, SamplingParams, Trajectory


class BackendError(RunFailed):
    """A rollout or learner backend failed (an actor died for good, a remote call passed its timeout); the message
    is one line naming what failed and the key that governs it. The trainer checkpoints and the command exits 1."""


class RolloutSource(Protocol):
    """Supplies the trajectories of each optimizer step and learns of each new policy version."""

    def next_batch(self, learner_version: int) -> list[Trajectory]:
        """The groups to train on at ``learner_version`` (blocks until they are ready)."""
        ...

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """The learner finished a step: ``model`` now holds policy ``version``."""
        ...

    def set_bound(self, k: int) -> None:
        """The staleness bound k in force from the next batch on (``async.max_staleness: auto``)."""
        ...

    def metrics(self) -> dict[str, float]:
        """The source's own per-step metrics (e.g. samples dropped for staleness)."""
        ...

    def state(self) -> dict[str, Any]:
        """JSON-able state that a checkpoint needs to resume this source exactly."""
        ...

    def load_state(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class ProblemStream:
    """Training problems in a fixed order: group ``g`` is problem ``g % P`` of batch ``g // P``.

    Batch ``i`` is drawn with its own seed, so any batch can be regenerated on its own (resume,
    worker processes) and the order does not depend on how the rollouts were scheduled.
    """

    def __init__(self, task, seed: int, prompts_per_step: int) -> None:
        self.task = task
        self.seed = seed
        self.prompts_per_step = prompts_per_step
        self._cache: dict[int, list[Problem]] = {}

    def batch(self, index: int) -> list[Problem]:
        if index not in self._cache:
            if len(self._cache) > 64:
                self._cache.clear()
            stream_batch = getattr(self.task, "stream_batch", None)  # a finite dataset walks its records in epochs
            self._cache[index] = (
                stream_batch(index, self.prompts_per_step, self.seed) if stream_batch is not None
                else self.task.problems("train", self.prompts_per_step, seed=self.seed * 1_000_003 + index)
            )
        return self._cache[index]

    def group(self, group_index: int) -> Problem:
        return self.batch(group_index // self.prompts_per_step)[group_index % self.prompts_per_step]


def generator_for(seed: int, index: int) -> torch.Generator:
    """The sampling RNG of batch (or group) ``index``: fixed by the seed, independent of scheduling."""
    return torch.Generator().manual_seed(seed * 7_919 + index)


@dataclass
class RolloutContext:
    """What every source needs to turn problems into scored groups."""

    tokenizer: Any
    task: Any
    stream: ProblemStream
    sampling: SamplingParams
    group_size: int
    seed: int


def trajectory_to_dict(t: Trajectory) -> dict[str, Any]:
    d = t.__dict__.copy()
    d["sampling"] = t.sampling.__dict__.copy()
    return d


def trajectory_from_dict(d: dict[str, Any]) -> Trajectory:
    return Trajectory(**{**d, "sampling": SamplingParams(**d["sampling"])})


def held_groups_state(finished: list[list[Trajectory]], unfinished: set[int]) -> dict[str, Any]:
    """What an async source's checkpoint keeps of the groups it admitted and has not trained (docs/trainer.md, what
    an async resume keeps): ``queued``, the finished groups (one copy of each, in the given order) with their tokens,
    log-probs and versions; ``requeued``, the indices of the others, ascending (a finished one left out)."""
    groups = list({group[0].group_id: group for group in finished}.values())
    ids = {group[0].group_id for group in groups}
    return {"queued": [[trajectory_to_dict(t) for t in group] for group in groups],
            "requeued": sorted(unfinished - ids)}


def held_groups(state: dict[str, Any]) -> tuple[list[list[Trajectory]], list[int]]:
    """The finished groups and the unfinished indices :func:`held_groups_state` kept (none from an older checkpoint)."""
    queued = [[trajectory_from_dict(d) for d in group] for group in state.get("queued", [])]
    return queued, [int(i) for i in state.get("requeued", [])]
