"""The learner group: ``trainer.num_learners`` Ray actors, data-parallel ranks of one torch.distributed group
(vcpo.train.data_parallel), behind the ``Learner`` interface the training loop already uses.

The driver keeps a mirror of the policy (evaluation, checkpoints): after each step rank 0 puts the new weights in
the object store once; the driver loads that object into the mirror and posts it on the ``WeightBoard``, so the
rollout actors fetch the same object. Every rank holds the same weights and optimizer state (the same all-reduced
gradient, the same AdamW step), so any live rank can give the state a checkpoint needs.

With ``trainer.sharding: fsdp`` (vcpo.train.sharding) the ranks are built from the driver's weights (rank 0 reads them,
the others build on the meta device), each step's weights are gathered a layer at a time and rank 0 puts each layer
in the store (no rank holds a second whole copy), the driver copies them into the mirror (which the board then puts
for the rollout actors), and the ranks write and read their checkpoint shards themselves, in the run directory (a
filesystem every learner node sees). A lost rank takes its shards with it: the run ends, and resumes from the last
checkpoint."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import ray
import torch

from vcpo.config import Config, config_from_dict
from vcpo.models.lora import apply_lora_config, sync_state_dict
from vcpo.orchestration.base import BackendError
from vcpo.orchestration.ray.broadcast import BroadcastMember, Failed, Layout, attempt, broadcast_layout, free_endpoint
from vcpo.orchestration.ray.placement import LearnerPlacement, node_id
from vcpo.orchestration.ray.session import RemoteFailed, error_line, gather, get
from vcpo.orchestration.ray.weights import WeightBoard, host_state_dict
from vcpo.types import Batch


class LearnerActor:
    """One rank: its own copy of the policy and optimizer. The ``step`` calls (join, load, step, weight broadcast)
    run one at a time in one thread, the control calls in another,
    so a checkpoint can ask a rank for its optimizer state after another rank died: the state is copied under the
    learner's ``update_lock``, which a step holds only while it changes the state (after its collectives), so the
    answer comes at once even while this rank's step still waits in a collective on the lost peer (until gloo sees
    the closed connection, or the collectives' timeout, ``ray.timeout_s``)."""

    def __init__(self, config_tree: dict, model_path: str, rank: int, world_size: int) -> None:
        from vcpo.models.loading import load_policy
        from vcpo.runtime import configure_cpu, resolve_device

        self.config = config_from_dict(config_tree)
        configure_cpu(self.config.runtime.torch_threads)
        self.device = resolve_device(self.config.model.device)
        self.sharded = self.config.trainer.sharding == "fsdp"
        self.model_path = model_path
        self.model = None if self.sharded else apply_lora_config(
            load_policy(model_path, self.config.model.dtype, self.device)[0], self.config.model.lora)
        self.rank, self.world_size = rank, world_size
        self.learner = None
        self.broadcast: BroadcastMember | None = None

    @ray.method(concurrency_group="control")
    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port for a process group: the learners' or the weight broadcast's (asked of
        rank 0)."""
        return free_endpoint()

    @ray.method(concurrency_group="control")
    def node(self) -> str:
        return node_id()

    @ray.method(concurrency_group="step")
    def join(self, address: str, port: int, initial: list | None = None) -> None:
        """Join the group; a sharded rank builds its model then, from the driver's weights ``initial`` (``[ref]``,
        which rank 0 reads)."""
        from vcpo.train.data_parallel import DataParallelLearner, init_process_group
        from vcpo.train.learner import Learner

        if self.world_size == 1 and not self.sharded:
            self.learner = Learner(self.model, self.config)
            return
        init_process_group(self.rank, self.world_size, address, port, self.config.ray.timeout_s)
        if self.sharded:
            from vcpo.train.sharding import ShardedLearner, build_sharded_model

            weights = ray.get(initial[0]) if self.rank == 0 else None
            self.model = build_sharded_model(self.model_path, self.config, self.device, weights)
            self.learner = ShardedLearner(self.model, self.config)
            return
        self.learner = DataParallelLearner(self.model, self.config)

    @ray.method(concurrency_group="step")
    def load(self, version: int, weights: list, optimizer_state: list) -> None:
        """Weights (the driver's mirror, e.g. after a resume) and optimizer state, when given, at ``version``."""
        with self.learner.update_lock, torch.no_grad():
            if weights[0] is not None:
                for key, value in ray.get(weights[0]).items():
                    self.model.state_dict()[key].copy_(value)
            if optimizer_state[0] is not None:
                self.learner.optimizer.load_state_dict(ray.get(optimizer_state[0]))
            self.learner.version = version

    @ray.method(concurrency_group="step")
    def step(self, batch: Batch, lr: float, version: int | None = None) -> tuple[dict[str, float], list | None,
                                                                                 str | None]:
        """One optimizer step from ``version`` (None: the rank's own) on the global batch at learning rate ``lr``
        (before the ESS scale; skipped on every rank alike when a global statistic is not finite); rank 0 also returns
        [ref] of the new weights in the store (sharded: a ref per layer)."""
        self.learner.lr = lr
        if version is not None:
            self.learner.version = version
        metrics = self.learner.step(batch)
        t0 = time.perf_counter()
        if self.sharded:
            refs = self.put_layers()
        elif self.rank == 0:
            refs = [ray.put(host_state_dict(self.model))]
        if self.rank != 0:
            return metrics, None, self.learner.skip_reason
        return metrics | {"time/weight_put_s": time.perf_counter() - t0}, refs, self.learner.skip_reason

    def put_layers(self) -> list:
        """Sharded: every rank gathers the weights a layer at a time; rank 0 puts each layer in the store."""
        from vcpo.train.sharding import gathered_layers

        refs = []
        for layer in gathered_layers(self.model):
            if self.rank == 0:
                refs.append(ray.put({key: value.detach().to("cpu") for key, value in layer.items()}))
        return refs

    @ray.method(concurrency_group="step")
    def save_sharded(self, path: str) -> None:
        from vcpo.train.sharding import save_sharded

        save_sharded(self.model, self.learner.optimizer, path)

    @ray.method(concurrency_group="step")
    def load_sharded(self, path: str) -> list:
        """Read this rank's shards of a checkpoint; rank 0 returns the weights' layer refs (``step``'s)."""
        from vcpo.train.sharding import load_sharded

        load_sharded(self.model, self.learner.optimizer, path)
        return self.put_layers()

    @ray.method(concurrency_group="step")
    def put_weights(self) -> Any:
        """This rank's weights in the object store (what rank 0 returns from each step)."""
        return ray.put(host_state_dict(self.model))

    @ray.method(concurrency_group="step")
    def broadcast_plan(self) -> tuple[str, Layout]:
        """Rank 0's device type and what it broadcasts to the rollout actors (``ray.weight_sync: broadcast``)."""
        return next(self.model.parameters()).device.type, broadcast_layout(sync_state_dict(self.model))

    @ray.method(concurrency_group="step")
    def join_broadcast(self, address: str, port: int, world_size: int, backend: str, layout: Layout) -> Failed | None:
        """Rank 0 of the weight-broadcast group (its own store on ``port``; a new group replaces an old one)."""
        def join() -> None:
            self.broadcast = BroadcastMember(address, port, 0, world_size, self.config.ray.timeout_s, backend, layout)

        return attempt(join)

    @ray.method(concurrency_group="step")
    def broadcast_weights(self) -> Failed | None:
        return attempt(self.broadcast.send, sync_state_dict(self.model))

    @ray.method(concurrency_group="control")
    def optimizer_state(self) -> tuple[int, dict[str, Any]]:
        """The version and a copy of the optimizer state at it (a copy: the reply is serialized after the lock is
        let go, while the next step may already change the state in place)."""
        with self.learner.update_lock:
            return self.learner.version, copy.deepcopy(self.learner.optimizer.state_dict())


class _OptimizerProxy:
    """What checkpoints see as ``learner.optimizer``: ``state_dict`` from a live rank at the driver's version,
    ``load_state_dict`` pushed to every rank before the next step."""

    def __init__(self, group: LearnerGroup) -> None:
        self.group = group
        self.pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        last: BaseException | None = None
        for rank, actor in enumerate(self.group.actors):  # every rank holds the same state: any live one will do
            try:
                version, state = get(actor.optimizer_state.remote(), min(self.group.timeout_s, 30.0),
                                     f"learner rank {rank}")
            except (BackendError, ray.exceptions.RayError) as exc:
                last = exc
                continue
            if version == self.group.version:
                return state
        raise BackendError(f"no learner rank could give the optimizer state of step {self.group.version} ({last})")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = state


class _ShardedState:
    """What checkpoints see as ``learner.optimizer`` under ``trainer.sharding: fsdp``: every rank writes and reads its
    own shards (vcpo.train.checkpoint); after a load the driver's mirror takes the ranks' weights."""

    def __init__(self, group: LearnerGroup) -> None:
        self.group = group

    def save_sharded(self, path: str | Path) -> None:
        self.group._call([a.save_sharded.remote(str(path)) for a in self.group.actors], "the sharded checkpoint")

    def load_sharded(self, path: str | Path) -> None:
        refs = self.group._call([a.load_sharded.remote(str(path)) for a in self.group.actors],
                                "loading the sharded checkpoint")[0]
        self.group.mirror(refs)


class LearnerGroup:
    """``trainer.num_learners`` learner actors behind the ``Learner`` interface (``step``, ``version``, ``lr``,
    ``optimizer``, ``model``, ``device``)."""

    def __init__(self, model: torch.nn.Module, config: Config, model_path: str, board: WeightBoard) -> None:
        rc, n = config.ray, config.trainer.num_learners
        self.model, self.config, self.board, self.timeout_s = model, config, board, rc.timeout_s
        self.device = next(model.parameters()).device
        self.version = 0
        self.lr = config.trainer.lr  # sent with each step
        self.skip_reason: str | None = None
        self.synced_version: int | None = None  # the version the ranks' weights are known to match
        self.sharded = config.trainer.sharding == "fsdp"
        self.optimizer = _ShardedState(self) if self.sharded else _OptimizerProxy(self)
        actor_cls = ray.remote(concurrency_groups={"step": 1, "control": 1})(LearnerActor)
        self.placement = LearnerPlacement(rc, n)  # every rank's bundle reserved, or one line
        self.actors = [actor_cls.options(**self.placement.options(rank), max_restarts=0)
                       .remote(config.to_dict(), model_path, rank, n) for rank in range(n)]
        address, port = get(self.actors[0].rendezvous.remote(), rc.start_timeout_s, "learner rank 0 (start)",
                            "ray.start_timeout_s")
        initial = [ray.put(host_state_dict(model))] if self.sharded else [None]  # a sharded rank 0 starts from it
        self._call([a.join.remote(address, port, initial) for a in self.actors], "the learner group (process group)",
                   start=True)

    def _call(self, refs: list, what: str, start: bool = False) -> list:
        """All ranks' answers (within ``ray.start_timeout_s`` at the ``start``, else ``ray.timeout_s``); the first rank
        to fail (a dead actor) ends the wait at once, not at the timeout."""
        try:
            if start:
                return gather(refs, self.config.ray.start_timeout_s, what, key="ray.start_timeout_s")
            return gather(refs, self.timeout_s, what)
        except RemoteFailed as failed:
            exc = failed.error
            if isinstance(exc, ray.exceptions.RayActorError):
                raise BackendError(f"learner rank {failed.index} died during {what} ({type(exc).__name__})") from None
            if isinstance(exc, ray.exceptions.RayTaskError):  # e.g. a collective that lost its peer
                raise BackendError(f"learner rank {failed.index} failed during {what}: "
                                   f"{error_line(exc.cause)}") from None
            raise exc from None

    def _sync(self) -> None:
        """Before the first step (and after a resume): the driver's weights and optimizer state to every rank (sharded
        ranks started from the driver's weights and read their checkpoints themselves)."""
        if self.sharded or (self.synced_version == self.version and self.optimizer.pending is None):
            return
        weights = ray.put(host_state_dict(self.model))
        state = None if self.optimizer.pending is None else ray.put(self.optimizer.pending)
        self._call([a.load.remote(self.version, [weights], [state]) for a in self.actors], "loading the weights")
        self.optimizer.pending, self.synced_version = None, self.version

    def step(self, batch: Batch) -> dict[str, float]:
        """One data-parallel step; the driver's mirror then holds the new weights, posted for the rollout actors."""
        self._sync()
        t0 = time.perf_counter()
        batch_ref = ray.put(batch)  # once, whatever the number of ranks
        refs = [a.step.remote(batch_ref, self.lr, self.version) for a in self.actors]
        try:
            answer = self._call(refs, f"learner step {self.version + 1}")[0]
        except BackendError:
            answer = self._taken_by_a_survivor(refs)
            if answer is None:
                raise
        metrics, ref, self.skip_reason = answer
        t1 = time.perf_counter()
        try:
            self.mirror(ref)
        except ray.exceptions.RayError:  # the rank that put the weights died since (its objects with it)
            ref = self._weights_of_a_survivor(f"learner step {self.version + 1}")
            self.mirror(ref)
        self.version += 1
        self.synced_version = self.version
        if not self.sharded:  # the ranks' object is the whole state: the rollout actors fetch it (else the driver's)
            self.board.post(self.version, ref[0])
        return metrics | {"time/learner_group_s": t1 - t0, "time/weight_sync_s": metrics.get("time/weight_put_s", 0.0)
                          + time.perf_counter() - t1}

    def mirror(self, refs: list) -> None:
        """The ranks' weights (a ref to the whole state, or one per layer) into the driver's mirror, one at a time."""
        with torch.no_grad():
            state = self.model.state_dict()
            for ref in refs:
                for key, value in get(ref, self.timeout_s, "the new weights").items():
                    state[key].copy_(value)

    def _weights_of_a_survivor(self, what: str) -> list:
        """[ref] of the new weights put again by a live rank (every unsharded rank holds them after a finished step),
        when the rank that put them died after answering; one line when none can (sharded ranks hold shards)."""
        if not self.sharded:
            for rank, actor in enumerate(self.actors):
                try:
                    return [get(actor.put_weights.remote(), self.timeout_s, f"learner rank {rank}")]
                except (ray.exceptions.RayError, BackendError):
                    continue
        raise BackendError(f"a learner rank died after {what} and its new weights were lost with it")

    def _taken_by_a_survivor(self, refs: list) -> tuple | None:
        """After a rank failed during a step: the step's answer (metrics, [weights ref], skip reason) if a surviving
        rank finished it (its all-reduce completed before the peer died, so it holds the group's next weights and
        optimizer state, and the step is kept: logged, posted and checkpointable); None if none did (every survivor
        is still at the old version). Each survivor's call is waited for first (a collective with a dead peer fails
        at once, or at ``ray.timeout_s``), so that no rank is left mid-update when the checkpoint asks for its
        state."""
        ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        for rank, ref in enumerate(refs):
            try:
                metrics, weights, skip_reason = ray.get(ref, timeout=0)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                continue
            if weights is None and self.sharded:  # no rank holds the whole model: rank 0's answer alone will do
                continue
            if weights is None:  # only rank 0 puts its weights in the store with each step
                weights = [get(self.actors[rank].put_weights.remote(), self.timeout_s, f"learner rank {rank}")]
            return metrics, weights, skip_reason
        return None

    def nodes(self) -> list[str]:
        """The Ray node of each rank."""
        return get([a.node.remote() for a in self.actors], self.timeout_s, "learner node")

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        self.placement.remove()
