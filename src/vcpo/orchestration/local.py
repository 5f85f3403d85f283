"""Rollouts in the learner's process: synchronous (k = 0) and deterministically lagged (k steps)."""

from __future__ import annotations

from typing import Any

import torch

from vcpo.errors import RunFailed
from vcpo.models.lora import sync_state_dict
from vcpo.orchestration.base import RolloutContext, generator_for, trajectory_from_dict, trajectory_to_dict
from vcpo.orchestration.filtering import DynamicSampling
from vcpo.orchestration.replay import split_groups
from vcpo.orchestration.tally import GroupTally
from vcpo.rollout.collect import collect_groups
from vcpo.types import DROPPED_STATUS, Trajectory, is_dropped_group


def _generate_batch(engine, ctx: RolloutContext, index: int) -> list[Trajectory]:
    P = ctx.stream.prompts_per_step
    groups = collect_groups(
        engine, ctx.tokenizer, ctx.task, ctx.stream.batch(index), list(range(index * P, (index + 1) * P)),
        ctx.group_size, ctx.sampling, generator_for(ctx.seed, index),
    )
    return [t for g in groups for t in g]


def _without_dropped(batch: list[Trajectory], index: int) -> tuple[list[Trajectory], int]:
    """The batch to train on, without the markers of groups an agent task dropped, and how many there were."""
    kept = [t for t in batch if t.reward_status != DROPPED_STATUS]
    if batch and not kept:
        raise RunFailed(f"every group of batch {index} was dropped by the agent task (the lines above say why; "
                        "task.kwargs.agent_retries runs a failed group again)")
    return kept, len(batch) - len(kept)


def _close_task(task: Any) -> None:
    """Stop what the task started in this process (an agent task's endpoint and runner)."""
    close = getattr(task, "close", None)
    if close is not None:
        close()


def _agent_metrics(dropped: int) -> dict[str, float]:
    return {"agent/dropped_groups": float(dropped)} if dropped else {}


class _Batches:
    """Where a local source's batches come from: batch ``index`` of the problem stream (``rollout.filter: none``),
    or, with dynamic sampling, rounds of P groups read from a cursor into the stream (``next_group``, kept in the
    checkpoint) until a step has P informative groups or hit the cap; a round's surplus informative groups are not
    trained (the next round would be one step staler)."""

    def __init__(self, ctx: RolloutContext, sampling: DynamicSampling | None) -> None:
        self.ctx, self.sampling = ctx, sampling
        self.next_group = 0

    def make(self, engine, index: int) -> tuple[list[Trajectory], dict[str, float]]:
        """The batch trained at step ``index`` and its metrics: ``groups/*`` (vcpo.orchestration.tally) and, with a
        filter, ``filter/*``."""
        tally = GroupTally()
        if self.sampling is None:
            batch = _generate_batch(engine, self.ctx, index)
            for group in split_groups(batch):
                tally.add(group, "trained")
            return batch, tally.take()
        ctx, fill = self.ctx, self.sampling.fill()
        markers: list[list[Trajectory]] = []  # groups an agent task dropped: never judged, left out at train time
        generated = 0  # markers included: a task that drops every group still ends at the cap
        while not fill.done and generated < fill.cap:
            n = min(ctx.stream.prompts_per_step, fill.room, fill.cap - generated)
            indices = list(range(self.next_group, self.next_group + n))
            for group in collect_groups(engine, ctx.tokenizer, ctx.task, [ctx.stream.group(i) for i in indices],
                                        indices, ctx.group_size, ctx.sampling, generator_for(ctx.seed, indices[0])):
                if is_dropped_group(group):
                    markers.append(group)
                else:
                    fill.offer(group)
            self.next_group = indices[-1] + 1
            generated += n
        groups, metrics = fill.result()
        fill.record(tally)
        return [t for g in groups + markers for t in g], metrics | tally.take()

    def state(self) -> dict[str, Any]:
        return {} if self.sampling is None else {"next_group": self.next_group}

    def load_state(self, state: dict[str, Any]) -> None:
        self.next_group = int(state.get("next_group", 0))


def _at_version(engine, remote_model: torch.nn.Module | None, version: int) -> None:
    """Make ``engine`` sample with policy ``version``: an in-process engine shares the learner's model and only
    takes the tag; a remote one (``remote_model`` given: the learner's) gets the weights published."""
    if remote_model is None:
        engine.version = version
    elif engine.version != version:
        engine.load_weights(sync_state_dict(remote_model), version)


def _made_at(batch: list[Trajectory], index: int) -> int:
    """The policy version that generated a queued batch (``index`` itself, lag 0, if it holds no token)."""
    return min((v for t in batch for v in t.versions), default=index)


class SyncSource:
    """Generate batch t with the current weights, then train on it: every token has lag 0.

    ``remote_model``: the learner's model, whose weights are published to an engine that does not share it;
    ``sampling``: dynamic sampling (``rollout.filter``), refilling each batch at the current weights."""

    def __init__(self, engine, ctx: RolloutContext, remote_model: torch.nn.Module | None = None,
                 sampling: DynamicSampling | None = None) -> None:
        self.engine = engine
        self.ctx = ctx
        self.remote_model = remote_model
        self.batches = _Batches(ctx, sampling)
        self._metrics: dict[str, float] = {}
        self.agent_dropped = 0

    def next_batch(self, learner_version: int) -> list[Trajectory]:
        _at_version(self.engine, self.remote_model, learner_version)
        batch, self._metrics = self.batches.make(self.engine, learner_version)
        batch, dropped = _without_dropped(batch, learner_version)
        self.agent_dropped += dropped
        return batch

    def publish(self, model: torch.nn.Module, version: int) -> None:
        if self.remote_model is None:
            self.engine.version = version  # a remote engine gets the weights when the next batch needs them

    def set_bound(self, k: int) -> None:
        pass  # every token has lag 0 whatever the bound

    def metrics(self) -> dict[str, float]:
        return self._metrics | _agent_metrics(self.agent_dropped)

    def state(self) -> dict[str, Any]:
        return self.batches.state()

    def load_state(self, state: dict[str, Any]) -> None:
        self.batches.load_state(state)

    def close(self) -> None:
        _close_task(self.ctx.task)


class LaggedSource:
    """Batch t is generated with the weights of step max(0, t - k), exactly, for reproducible science.

    Rather than keeping k old copies of the weights, batch t + k is generated right after the step
    that produced version t, while those weights are current, and waits in a queue; the queue is
    part of the checkpoint, so a resumed run trains on exactly the same batches. ``remote_model`` as in SyncSource.

    When k changes (``set_bound``) at version v, every queued batch that would be trained at a lag above the new k
    is dropped, and each missing batch of v..v+k is generated from version v: lowering k from K to K' restarts the
    lag at 0 (the weights of v - K' are gone), from where it grows by one per step back to K'; raising it lets the
    lag grow one step per step from K to K' after the K queued batches are used up. Either way no batch is ever
    trained at a lag above the k in force, and the run stays exactly reproducible.

    With dynamic sampling (``sampling``) each batch is filled when it is generated, at the weights it is generated
    with. Its ``filter/*`` and ``groups/*`` metrics are reported at the step that trains it (queued with it; the
    batches a lowered bound drops are counted in ``staleness/dropped_over_bound`` only).
    """

    def __init__(self, engine, ctx: RolloutContext, max_staleness: int,
                 remote_model: torch.nn.Module | None = None, sampling: DynamicSampling | None = None) -> None:
        self.engine = engine
        self.ctx = ctx
        self.remote_model = remote_model
        self.k = max_staleness
        self.batches = _Batches(ctx, sampling)
        self.pending: dict[int, list[Trajectory]] = {}
        self.pending_metrics: dict[int, dict[str, float]] = {}  # filter/* and groups/* of each queued batch
        self._metrics: dict[str, float] = {}  # of the batch trained last
        self.dropped = 0  # groups of the batches dropped for a lowered bound
        self.adaptive = False  # set_bound was called: the drop count is reported
        self.agent_dropped = 0

    def _fill(self, version: int) -> None:
        """Drop the queued batches that would lag more than k; generate every missing batch of version..version+k
        from ``version`` (at the start of a run, batches 0..k all use version 0)."""
        for index in [i for i, b in self.pending.items() if i - _made_at(b, i) > self.k]:
            self.dropped += len({t.group_id for t in self.pending.pop(index)})
            self.pending_metrics.pop(index, None)
        missing = [i for i in range(version, version + self.k + 1) if i not in self.pending]
        if missing:
            _at_version(self.engine, self.remote_model, version)
        for index in missing:
            self.pending[index], self.pending_metrics[index] = self.batches.make(self.engine, index)

    def next_batch(self, learner_version: int) -> list[Trajectory]:
        if learner_version not in self.pending:
            self._fill(learner_version)
        self._metrics = self.pending_metrics.pop(learner_version, {})
        batch, dropped = _without_dropped(self.pending.pop(learner_version), learner_version)
        self.agent_dropped += dropped
        return batch

    def publish(self, model: torch.nn.Module, version: int) -> None:
        self._fill(version)

    def set_bound(self, k: int) -> None:
        self.k = k  # applied by the next publish (or next_batch after a resume)
        self.adaptive = True

    def metrics(self) -> dict[str, float]:
        bound = {"staleness/dropped_over_bound": float(self.dropped)} if self.adaptive else {}
        return bound | self._metrics | _agent_metrics(self.agent_dropped)

    def state(self) -> dict[str, Any]:
        """The queued batches by index (``"dropped"``: the drop count, when any batch was dropped; ``"batches"``:
        each queued batch's metrics and, with dynamic sampling, the stream cursor)."""
        state: dict[str, Any] = {str(i): [trajectory_to_dict(t) for t in b] for i, b in self.pending.items()}
        state["batches"] = self.batches.state() | {"metrics": {str(i): m for i, m in self.pending_metrics.items()}}
        return state | ({"dropped": self.dropped} if self.dropped else {})

    def load_state(self, state: dict[str, Any]) -> None:
        self.dropped = int(state.get("dropped", 0))
        batches = state.get("batches", {})
        self.batches.load_state(batches)
        self.pending_metrics = {int(i): m for i, m in batches.get("metrics", {}).items()}
        self.pending = {int(i): [trajectory_from_dict(d) for d in b] for i, b in state.items()
                        if i not in ("dropped", "batches")}

    def close(self) -> None:
        _close_task(self.ctx.task)
