"""Rollout actors and the driver's ``RaySource``: each actor owns an engine and generates the groups it is sent;
the driver admits groups under the ``StalenessController`` rules, filters them at batch time, re-issues the groups
of an actor that died, and offers every new weight version to all actors: one object in the object store (the
in-process engine, which ``ray.weight_sync: broadcast`` sends ahead from learner rank 0 in a process group), or,
with inference servers, the version number once the driver has published it to them."""

from __future__ import annotations

import os
import random
import threading
import time
from collections import deque
from typing import Any

import ray
import torch

from vcpo.models.lora import sync_state_dict
from vcpo.orchestration.base import BackendError, generator_for, held_groups, held_groups_state
from vcpo.orchestration.filtering import DynamicSampling
from vcpo.orchestration.ray.broadcast import BroadcastMember, Failed, Layout, WeightBroadcast, attempt
from vcpo.orchestration.ray.placement import node_id, rollout_options
from vcpo.orchestration.ray.session import error_line, get
from vcpo.orchestration.ray.weights import WeightBoard, host_state_dict
from vcpo.orchestration.staleness import StalenessController
from vcpo.orchestration.tally import GroupTally
from vcpo.orchestration.worker import WorkerSpec, build_worker
from vcpo.rollout.weights import WeightPublisher
from vcpo.types import Trajectory

REQUESTS_PER_ACTOR = 2  # one generating, one queued: an actor never idles while the driver trains


class RolloutActor:
    """A Ray actor (threaded: rollouts in one thread, weight offers and ``pid`` in another) owning one engine.

    New weights are offered as (version, [ObjectRef]); the actor fetches the newest one from the object store
    before each request and, with in-flight updates, between decode steps; a version received by broadcast
    (``receive_weights``) is swapped in at the same points, without a fetch. With inference servers
    (``spec.server``) the actor is a thin HTTP client over every server of ``rollout.server.urls``: the driver has
    already brought the servers to the offered version, so the offer only tells the engine which version its calls
    run under (``vcpo serve`` tags each token itself; vLLM and SGLang tokens get the version known when the call was
    sent). ``jitter_s`` pauses a random time up to it before each decode step (tests use it to make actors finish
    out of order)."""

    def __init__(self, spec: WorkerSpec, timeout_s: float, jitter_s: float = 0.0) -> None:
        self.spec, self.timeout_s, self.jitter = spec, timeout_s, jitter_s
        self.offered: tuple[int, Any] | None = None
        self.lock = threading.Lock()
        self.engine, self.tokenizer, self.task, self.stream = build_worker(spec, version_of=self.offered_version)
        self.rng = random.Random(os.getpid())
        self.load_s: list[float] = []
        self.broadcast: BroadcastMember | None = None

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def node(self) -> str:
        return node_id()

    @ray.method(concurrency_group="control")
    def sync_device(self) -> str:
        return self.engine.device.type

    @ray.method(concurrency_group="control")
    def join_broadcast(self, address: str, port: int, rank: int, world_size: int, backend: str,
                       layout: Layout) -> Failed | None:
        """Rank ``rank`` of the weight-broadcast group (``ray.weight_sync: broadcast``); replaces an older group."""
        def join() -> None:
            self.broadcast = BroadcastMember(address, port, rank, world_size, self.timeout_s, backend, layout)

        return attempt(join)

    @ray.method(concurrency_group="control")
    def receive_weights(self, version: int) -> Failed | None:
        """Receive ``version`` from learner rank 0 into fresh buffers; the generating thread swaps it in between decode
        steps (or before its next request), as it would an object fetched from the store."""
        def receive() -> None:
            state = self.broadcast.receive()
            with self.lock:
                if self.offered is None or version > self.offered[0]:
                    self.offered = (version, state)

        return attempt(receive)

    @ray.method(concurrency_group="control")
    def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """The engine's version and weights (host copies)."""
        return self.engine.version, host_state_dict(self.engine.model)

    @ray.method(concurrency_group="control")
    def offer(self, version: int, ref: list) -> None:
        with self.lock:
            if self.offered is None or version > self.offered[0]:
                self.offered = (version, ref[0])

    def offered_version(self) -> int:
        with self.lock:
            return -1 if self.offered is None else self.offered[0]

    def pause(self) -> None:
        if self.jitter:
            time.sleep(self.rng.uniform(0, self.jitter))

    def poll(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest offered weights if the engine does not have them yet (fetched once per version)."""
        self.pause()
        with self.lock:
            offered = self.offered
        if self.spec.server is not None or offered is None or offered[0] == self.engine.version:
            return None
        if isinstance(offered[1], dict):  # received by broadcast
            return offered
        t0 = time.perf_counter()
        state = get(offered[1], self.timeout_s, f"weights of version {offered[0]}")
        self.load_s.append(time.perf_counter() - t0)
        return offered[0], state

    @ray.method(concurrency_group="rollout")
    def generate(self, indices: list[int], version: int, ref: list) -> tuple[list[list[Trajectory]], dict]:
        """Groups ``indices`` of the problem stream, sampled with at least weights ``version`` (``ref``)."""
        from vcpo.rollout.collect import collect_groups

        self.offer(version, ref)
        update = self.poll()
        if update is not None:
            self.engine.load_weights(update[1], update[0])
        groups = collect_groups(
            self.engine, self.tokenizer, self.task, [self.stream.group(i) for i in indices], indices,
            self.spec.group_size, self.spec.sampling, generator_for(self.spec.seed, indices[0]),
            weight_poll=self.poll if self.spec.inflight_updates else (lambda: self.pause()) if self.jitter else None,
        )
        loads, self.load_s = self.load_s, []
        return groups, {"weight_loads": len(loads), "weight_load_s": sum(loads)}


class RaySource:
    """``RolloutSource`` over ``num_workers`` rollout actors; the staleness rules run here, in the driver.

    With ``publisher`` (inference servers) the driver alone publishes each version to the servers, once, before
    offering it to the actors; without it the actors fetch the weights from the object store, or with ``broadcast``
    receive each learner version from learner rank 0 in a process group (the object store stays the fallback).
    ``sampling``: dynamic sampling, as in the local ``AsyncSource``."""

    def __init__(self, model: torch.nn.Module, spec: WorkerSpec, num_workers: int, max_staleness: int,
                 drop_older_than: float | None, start_version: int, board: WeightBoard, ray_config,
                 jitter_s: float = 0.0, publisher: WeightPublisher | None = None,
                 broadcast: WeightBroadcast | None = None, sampling: DynamicSampling | None = None) -> None:
        self.model, self.board, self.rc, self.publisher, self.broadcast = model, board, ray_config, publisher, broadcast
        self.P = spec.prompts_per_step
        self.chunk = max(1, -(-self.P // num_workers))  # groups per request: a step's groups spread over actors
        self.controller = StalenessController(max_staleness, self.P, drop_older_than)
        self.controller.set_version(start_version)
        self.controller.stats.admitted = start_version * self.P  # groups already consumed before a resume
        self.next_group = start_version * self.P
        actor_cls = ray.remote(concurrency_groups={"rollout": 1, "control": 1})(RolloutActor)
        options = rollout_options(ray_config)  # spread over the nodes that fit; one line if none does
        self.actors = [
            actor_cls.options(**options, max_restarts=ray_config.max_restarts, max_task_retries=0)
            .remote(WorkerSpec(**{**spec.__dict__, "worker_id": i}), ray_config.timeout_s, jitter_s)
            for i in range(num_workers)
        ]
        self.pending: deque[int] = deque()  # admitted group indices not yet sent (re-issued ones first)
        self.inflight: dict[Any, tuple[int, list[int], int]] = {}  # ref -> (actor, indices, actor's life)
        self.lives = [0] * num_workers  # how many times each actor was found dead
        self.probes: dict[Any, int] = {}  # pid() calls to restarting actors -> actor
        self.ready: deque[list[Trajectory]] = deque()
        # Every admitted group not yet trained is pending, in flight, ready (received), or taken for the step in
        # progress (until its publish); it enters the next before it leaves the last, and state() keeps one copy.
        self.taken: list[list[Trajectory]] = []
        self.stats = {"ray/actor_restarts": 0.0, "ray/reissued_groups": 0.0, "ray/weight_loads": 0.0,
                      "ray/weight_load_s": 0.0, "time/weight_publish_s": 0.0}
        if broadcast is not None:
            self.stats["time/weight_broadcast_s"] = 0.0
        self.current: tuple[int, Any] | None = None
        self.start_version = start_version
        self.sampling = sampling
        self.tally = GroupTally()
        self.batch_metrics: dict[str, float] = {}  # groups/* and filter/* of the last batch

    def pids(self) -> list[int]:
        return get([a.pid.remote() for a in self.actors], self.rc.timeout_s, "rollout actor pid")

    def nodes(self) -> list[str]:
        """The Ray node of each rollout actor (where it lives now: a restarted actor may have moved)."""
        return get([a.node.remote() for a in self.actors], self.rc.timeout_s, "rollout actor node")

    def _admit_and_send(self) -> None:
        while self.controller.try_admit() is not None:
            self.pending.append(self.next_group)
            self.next_group += 1
        busy = [0] * len(self.actors)
        for actor, _, _ in self.inflight.values():
            busy[actor] += 1
        for i, actor in enumerate(self.actors):
            while busy[i] < REQUESTS_PER_ACTOR and self.pending and i not in self.probes.values():
                indices = [self.pending.popleft() for _ in range(min(self.chunk, len(self.pending)))]
                version, ref = self.current
                self.inflight[actor.generate.remote(indices, version, [ref])] = (i, indices, self.lives[i])
                busy[i] += 1

    def _receive(self) -> None:
        """Wait for one request (or a restarting actor's probe). A request that failed because its actor died goes
        back to the front of the queue; the actor gets no new request until Ray has restarted it."""
        done, _ = ray.wait([*self.inflight, *self.probes], num_returns=1, timeout=self.rc.timeout_s)
        if not done:
            raise BackendError(f"no rollout request finished within ray.timeout_s={self.rc.timeout_s:g} s")
        if done[0] in self.probes:
            actor = self.probes.pop(done[0])
            try:
                ray.get(done[0])
            except ray.exceptions.ActorUnavailableError:  # still restarting: ask again
                self.probes[self.actors[actor].pid.remote()] = actor
            except ray.exceptions.ActorDiedError:
                raise self._gone(actor) from None
            return
        self._collect(done[0])

    def _collect(self, ref: Any) -> None:
        """The result of the finished request ``ref``: its groups into ``ready``, or, when its actor died and Ray
        restarts it, its indices back to the front of the queue."""
        actor, indices, life = self.inflight.pop(ref)
        try:
            groups, stats = ray.get(ref)
        except ray.exceptions.ActorDiedError:
            raise self._gone(actor) from None
        except ray.exceptions.RayTaskError as exc:  # the actor lives but its request raised (e.g. a weight fetch)
            raise BackendError(f"rollout actor {actor} failed: {error_line(exc.cause)}") from None
        except ray.exceptions.ActorUnavailableError:
            if life == self.lives[actor]:  # the first request to fail with this death: Ray restarts the actor
                self.lives[actor] += 1
                self.stats["ray/actor_restarts"] += 1
                self.probes[self.actors[actor].pid.remote()] = actor
            self.pending.extendleft(reversed(indices))
            self.stats["ray/reissued_groups"] += len(indices)
            return
        self.ready.extend(groups)
        self.stats["ray/weight_loads"] += stats["weight_loads"]
        self.stats["ray/weight_load_s"] += stats["weight_load_s"]

    def _gone(self, actor: int) -> BackendError:
        return BackendError(f"rollout actor {actor} died for good: its ray.max_restarts={self.rc.max_restarts} "
                            f"restarts are used up")

    def next_batch(self, learner_version: int) -> list[Trajectory]:
        if self.current is None:  # every actor started (engine and scorer loaded) before the first request
            get([a.pid.remote() for a in self.actors], self.rc.start_timeout_s, "starting the rollout actors",
                "ray.start_timeout_s")
            self.publish(self.model, self.start_version)
        if self.sampling is not None:
            return self._filled_batch(learner_version)
        batch: list[Trajectory] = []
        kept = 0
        while kept < self.P:
            if not self.ready:
                self._admit_and_send()
                self._receive()
                continue
            group = self.ready[0]
            if self.controller.keep(group, learner_version):
                self.taken.append(group)
                batch.extend(group)
                kept += 1
                self.tally.add(group, "trained")
            else:
                self.tally.add(group, "dropped")
            self.ready.popleft()
        self.batch_metrics = self.tally.take()
        self._admit_and_send()  # the actors work on the next groups while the learner steps
        return batch

    def _filled_batch(self, learner_version: int) -> list[Trajectory]:
        """``next_batch`` under dynamic sampling: a group without signal frees its admission capacity for another,
        until the step has P informative groups or hit the cap (vcpo.orchestration.filtering)."""
        fill = self.sampling.fill()
        while not fill.done:
            if not self.ready:
                self._admit_and_send()
                self._receive()
                continue
            group = self.ready[0]
            if not self.controller.keep(group, learner_version):
                self.tally.add(group, "dropped")
            elif fill.offer(group):
                self.taken.append(group)
            else:
                self.controller.release()
            self.ready.popleft()
        groups, filter_metrics = fill.result()
        self.taken = list(groups)  # at the cap, with the fillers
        self.controller.reclaim(fill.reclaimed)
        fill.record(self.tally)
        self.batch_metrics = filter_metrics | self.tally.take()
        self._admit_and_send()  # the actors work on the next groups while the learner steps
        return [t for g in groups for t in g]

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Offer version ``version`` to every actor: the learner group's object when it published one, else one
        ``ray.put`` of ``model``'s weights; actors fetch it themselves between decode steps. With servers, every
        server is first paused, updated and resumed (``publisher``); the actors then only learn the number. The
        batch just trained is no longer the source's to keep."""
        self.taken = []
        t0 = time.perf_counter()
        if self.publisher is not None:
            self.publisher.publish(sync_state_dict(model), version)
            ref = None
        else:  # the object store holds every version (the driver's mirror loads it): the fallback of a broadcast
            ref = self.board.ref(version, model)
            # Rank 0 holds the learner's versions only: the start version (e.g. a resumed checkpoint) goes by the store.
            if self.broadcast is not None and version > self.start_version:
                took = self.broadcast.send(self.actors, self.lives, version, restarting=bool(self.probes))
                self.stats["time/weight_broadcast_s"] = 0.0 if took is None else took
        self.current = (version, ref)
        for actor in self.actors:
            actor.offer.remote(version, [ref])
        self.controller.set_version(version)
        self.stats["time/weight_publish_s"] = time.perf_counter() - t0

    def set_bound(self, k: int) -> None:
        """The bound from now on; the next ``publish`` admits what it allows (vcpo.orchestration.staleness)."""
        self.controller.set_bound(k)

    def metrics(self) -> dict[str, float]:
        s = self.controller.stats
        out = {"staleness/dropped_over_bound": float(s.dropped_over_bound),
               "staleness/dropped_alpha": float(s.dropped_alpha)} | self.stats | self.batch_metrics
        if self.broadcast is not None:
            out |= self.broadcast.stats
        self.stats = dict.fromkeys(self.stats, 0.0) | {"ray/actor_restarts": self.stats["ray/actor_restarts"],
                                                        "ray/reissued_groups": self.stats["ray/reissued_groups"]}
        return out

    def state(self) -> dict[str, Any]:
        """The stream cursor and every admitted group not yet trained, as the local ``AsyncSource`` keeps them:
        ``queued`` (finished: requests done by now are collected first; each group with its tokens, log-probs and
        versions, the step in progress's groups first) and ``requeued`` (the indices in flight or not yet sent:
        generated again after a resume, before any new one)."""
        if self.inflight:
            done, _ = ray.wait(list(self.inflight), num_returns=len(self.inflight), timeout=0)
            for ref in done:
                indices = self.inflight[ref][1]
                try:
                    self._collect(ref)
                except BackendError:  # its actor is gone: the request's prompts are generated again after a resume
                    self.pending.extend(indices)
        in_flight = {i for _, indices, _ in self.inflight.values() for i in indices}
        return {"next_group": self.next_group} | held_groups_state([*self.taken, *self.ready],
                                                                   {*self.pending, *in_flight})

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue a run: its next group index and the groups it had admitted but not trained, which count as
        admitted; the finished ones are trained first (or dropped at batch time past the bound, as any group), the
        unfinished ones are sent again before any new index. A checkpoint without them (older vcpo) resumes at
        ``next_group``, past the groups it had admitted."""
        self.next_group = int(state.get("next_group", self.next_group))
        queued, requeued = held_groups(state)
        self.ready.extend(queued)
        self.pending.extendleft(reversed(requeued))
        self.controller.stats.admitted += len(queued) + len(requeued)

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
