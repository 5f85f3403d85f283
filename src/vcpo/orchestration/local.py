"""Rollouts in the learner's process: synchronous (k = 0) and deterministically lagged (k steps)."""

from __future__ import annotations

from typing import Any

import torch

from vcpo.models.lora import sync_state_dict
from vcpo.orchestration.base import RolloutContext, generator_for, trajectory_from_dict, trajectory_to_dict
from vcpo.rollout.collect import collect_groups
from vcpo.types import Trajectory


def _generate_batch(engine, ctx: RolloutContext, index: int) -> list[Trajectory]:
    P = ctx.stream.prompts_per_step
    groups = collect_groups(
        engine, ctx.tokenizer, ctx.task, ctx.stream.batch(index), list(range(index * P, (index + 1) * P)),
        ctx.group_size, ctx.sampling, generator_for(ctx.seed, index),
    )
    return [t for g in groups for t in g]


def _at_version(engine, remote_model: torch.nn.Module | None, version: int) -> None:
    """Make ``engine`` sample with policy ``version``: an in-process engine shares the learner's model and only
    takes the tag; a remote one (``remote_model`` given: the learner's) gets the weights published."""
    if remote_model is None:
        engine.version = version
    elif engine.version != version:
        engine.load_weights(sync_state_dict(remote_model), version)


class SyncSource:
    """Generate batch t with the current weights, then train on it: every token has lag 0.

    ``remote_model``: the learner's model, whose weights are published to an engine that does not share it."""

    def __init__(self, engine, ctx: RolloutContext, remote_model: torch.nn.Module | None = None) -> None:
        self.engine = engine
        self.ctx = ctx
        self.remote_model = remote_model

    def next_batch(self, learner_version: int) -> list[Trajectory]:
        _at_version(self.engine, self.remote_model, learner_version)
        return _generate_batch(self.engine, self.ctx, learner_version)

    def publish(self, model: torch.nn.Module, version: int) -> None:
        if self.remote_model is None:
            self.engine.version = version  # a remote engine gets the weights when the next batch needs them

    def metrics(self) -> dict[str, float]:
        return {}

    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class LaggedSource:
    """Batch t is generated with the weights of step max(0, t - k), exactly, for reproducible science.

    Rather than keeping k old copies of the weights, batch t + k is generated right after the step
    that produced version t, while those weights are current, and waits in a queue; the queue is
    part of the checkpoint, so a resumed run trains on exactly the same batches. ``remote_model`` as in SyncSource.
    """

    def __init__(self, engine, ctx: RolloutContext, max_staleness: int,
                 remote_model: torch.nn.Module | None = None) -> None:
        self.engine = engine
        self.ctx = ctx
        self.remote_model = remote_model
        self.k = max_staleness
        self.pending: dict[int, list[Trajectory]] = {}

    def _fill(self, version: int, indices: range) -> None:
        _at_version(self.engine, self.remote_model, version)
        for index in indices:
            if index not in self.pending:
                self.pending[index] = _generate_batch(self.engine, self.ctx, index)

    def next_batch(self, learner_version: int) -> list[Trajectory]:
        if learner_version not in self.pending:  # the start of a run: batches 0..k all use version 0
            self._fill(learner_version, range(learner_version, learner_version + self.k + 1))
        return self.pending.pop(learner_version)

    def publish(self, model: torch.nn.Module, version: int) -> None:
        self._fill(version, range(version + self.k, version + self.k + 1))

    def metrics(self) -> dict[str, float]:
        return {}

    def state(self) -> dict[str, Any]:
        return {str(i): [trajectory_to_dict(t) for t in b] for i, b in self.pending.items()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.pending = {int(i): [trajectory_from_dict(d) for d in b] for i, b in state.items()}

    def close(self) -> None:
        pass
