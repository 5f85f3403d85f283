"""True asynchrony on one machine: rollout worker processes overlap with the learner.

Weights travel through shared memory (one shared copy of the state dict and a version counter); each
worker has its own lock around it, its own ticket pipe (group indices in) and result pipe (groups out),
so that the learner knows which groups each worker holds. Workers poll the version before every decode
step when in-flight updates are on, else before each request. The learner admits rollout groups under
the staleness bound (vcpo.orchestration.staleness) and drops, at batch time, any group that would exceed
it. With inference servers (``rollout.engine: server``) the workers are HTTP clients and a ``WeightPublisher``
in the learner's process brings every server to each new version instead. A worker that dies is noticed at
once (its process sentinel) and restarted with the groups it held, up to ``max_restarts`` times; a worker
silent for ``handoff_timeout_s`` while it holds groups, or holding its weight lock that long, is an error
naming it. Nothing here ever waits without a deadline. A checkpoint keeps the finished groups not yet trained (with
their tokens and versions) and the indices of those still being generated, so that a resumed run trains every group
of the stream once (``state``, ``load_state``).
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp
from rich.console import Console

from vcpo.errors import RunFailed, signal_name
from vcpo.models.lora import sync_state_dict
from vcpo.orchestration.base import held_groups, held_groups_state
from vcpo.orchestration.filtering import DynamicSampling
from vcpo.orchestration.ordering import BatchOrder, make_order
from vcpo.orchestration.staleness import StalenessController
from vcpo.orchestration.tally import GroupTally
from vcpo.orchestration.worker import WorkerSpec, rollout_worker
from vcpo.rollout.weights import WeightPublisher
from vcpo.types import Trajectory

__all__ = ["AsyncSource", "WorkerSpec"]

_POLL_S = 0.05
_CLOSE_GRACE_S = 5.0
console = Console(stderr=True)


@dataclass
class _Worker:
    """The learner's handle on one worker process, and the group indices it holds (sent, not yet returned)."""

    process: Any
    tickets: Connection
    results: Connection
    lock: Any
    held: list[int] = field(default_factory=list)
    last_heard: float = field(default_factory=time.monotonic)
    error: str | None = None


def _exit_text(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        return f"was killed by {signal_name(-code)}"
    return f"exited with status {code}"


class AsyncSource:
    """Rollout worker processes, fed and restarted from the learner's (main) thread. ``sampling``: dynamic sampling
    (``rollout.filter``): a group without signal is dropped as it arrives, frees its admission capacity, and the
    workers generate another in its place. ``batch_order`` (``async.batch_order``, vcpo.orchestration.ordering):
    ``admission`` hands groups to a step in the order they were admitted, and admits within min(k, ceil(alpha)), so
    that no group is dropped for staleness and none is chosen by how long it took."""

    def __init__(self, model: torch.nn.Module, spec: WorkerSpec, num_workers: int, max_staleness: int,
                 drop_older_than: float | None, start_version: int = 0, max_restarts: int = 3,
                 publisher: WeightPublisher | None = None, sampling: DynamicSampling | None = None,
                 batch_order: BatchOrder = "arrival") -> None:
        self._ctx = mp.get_context("spawn")
        self.spec = spec
        self.P = spec.prompts_per_step
        self.num_workers = num_workers
        self.max_restarts = max_restarts
        self.publisher = publisher
        self.publish_s = 0.0
        self._model = model
        # A host copy whatever the learner's device: workers copy from it onto theirs (none when servers generate).
        self.shared = {} if publisher is not None else {
            k: v.detach().to("cpu", copy=True).share_memory_() for k, v in sync_state_dict(model).items()}
        # Read by workers without a lock, as a hint; written only while every worker's lock is held.
        self.version = self._ctx.RawValue("q", start_version)
        self.controller = StalenessController(max_staleness, self.P, drop_older_than,
                                              admit_within_alpha=batch_order == "admission")
        self.controller.set_version(start_version)
        self.controller.stats.admitted = start_version * self.P  # groups already consumed before a resume
        self.next_group = start_version * self.P
        self.workers: list[_Worker] = []
        self.restarts = 0
        self._before: dict[str, int] = {}  # counts of earlier processes of this run (resume)
        self._failure: str | None = None
        # Every admitted group not yet trained is in one of: a worker's held indices, the order (received), or the
        # groups taken for the batch of the step in progress (until its publish). It enters the next before it
        # leaves the last (a signal may end next_batch anywhere), and state() keeps one copy of each.
        self.batch_order = batch_order
        self._order = make_order(batch_order, self.next_group)  # groups received, not yet handed to next_batch
        self._taken: list[list[Trajectory]] = []
        self._reissue: list[int] = []  # admitted before a resume, unfinished then: issued first, ahead of new ones
        self.sampling = sampling
        self.tally = GroupTally()
        self._batch_metrics: dict[str, float] = {}  # groups/* and filter/* of the last batch

    def _spawn(self, worker_id: int) -> _Worker:
        ticket_reader, ticket_writer = self._ctx.Pipe(duplex=False)
        result_reader, result_writer = self._ctx.Pipe(duplex=False)
        lock = self._ctx.Lock()
        process = self._ctx.Process(
            target=rollout_worker, daemon=True, name=f"vcpo-rollout-{worker_id}",
            args=(replace(self.spec, worker_id=worker_id), self.shared, self.version, ticket_reader, result_writer,
                  lock),
        )
        process.start()  # from the main thread: the worker's parent-death signal follows this thread
        ticket_reader.close()  # the worker holds the only other ends, so its death reads as end-of-file here
        result_writer.close()
        return _Worker(process, ticket_writer, result_reader, lock)

    def _admit(self) -> None:
        """Issue the groups a resumed run had admitted and not finished (admitted already), then every group the
        staleness bound admits now, each to the worker holding the fewest."""
        for index in self._reissue:
            self._send(min(self.workers, key=lambda w: len(w.held)), index)
        self._reissue = []
        while self.controller.try_admit() is not None:
            self._send(min(self.workers, key=lambda w: len(w.held)), self.next_group)
            self.next_group += 1

    def _send(self, worker: _Worker, index: int) -> None:
        if not worker.held:
            worker.last_heard = time.monotonic()  # an idle worker's silence was no stall
        worker.held.append(index)
        try:
            worker.tickets.send(index)
        except OSError:  # it died: the receive loop notices and re-issues what it held
            pass

    def _replace(self, worker: _Worker, defer: bool = False) -> _Worker | None:
        """Restart a dead or stalled worker with the groups it held; with the restarts used up, stop the run
        (at once, or with ``defer`` at the next ``next_batch``, so that a finished step is logged first)."""
        i = self.workers.index(worker)
        self._reap(worker)
        why = f"rollout worker {i} {_exit_text(worker.process.exitcode)}"
        why += f" ({worker.error})" if worker.error else ""
        if self.restarts >= self.max_restarts:
            self._failure = f"{why}; no restart left (async.max_worker_restarts={self.max_restarts})"
            if defer:
                return None
            raise RunFailed(self._failure)
        self.restarts += 1
        self.workers[i] = new = self._spawn(i)
        console.print(f"warning: {why}; restarted it ({self.restarts} of {self.max_restarts}), re-issuing "
                      f"{len(worker.held)} group(s)", markup=False, highlight=False, soft_wrap=True)
        for index in worker.held:  # still admitted: the bound is checked again when each comes back
            self._send(new, index)
        return new

    def _reap(self, worker: _Worker) -> None:
        worker.process.join(timeout=_CLOSE_GRACE_S)
        worker.tickets.close()
        worker.results.close()

    def _take(self, worker: _Worker) -> bool:
        """Read one message of ``worker`` into the order (a group) or its error; False at its end (death)."""
        try:
            kind, payload = worker.results.recv()
        except (EOFError, OSError, pickle.UnpicklingError):  # died, possibly in the middle of a message
            return False
        worker.last_heard = time.monotonic()
        if kind == "error":
            worker.error = payload
        else:
            self._order.put(payload)
            if payload[0].group_id in worker.held:
                worker.held.remove(payload[0].group_id)
        return True

    def _bury(self, worker: _Worker, defer: bool = False) -> _Worker | None:
        """A worker ended: keep every group it finished sending, then restart it with the rest (``_replace``)."""
        while self._take(worker):
            pass
        return self._replace(worker, defer)

    def _receive(self) -> list[Trajectory]:
        """The next finished group in ``batch_order`` (the first to arrive, or the next admitted), left at the head of
        the order for the caller to take (``pop``); a worker that died is replaced as soon as it is seen."""
        while (group := self._order.peek()) is None:
            by_conn = {w.results: w for w in self.workers}
            by_sentinel = {w.process.sentinel: w for w in self.workers}
            for ready in wait([*by_conn, *by_sentinel], timeout=_POLL_S):
                worker = by_conn.get(ready) or by_sentinel[ready]
                if worker not in self.workers:  # replaced earlier in this round
                    continue
                if ready is not worker.results or not self._take(worker):
                    self._bury(worker)
            index = self._order.waiting_for()
            if index is not None and self._order.peek() is None and not any(index in w.held for w in self.workers):
                raise RunFailed(f"async.batch_order=admission waits for group {index}, which no rollout worker holds: "
                                "it would wait forever (a bug in vcpo: please report it)")
            now = time.monotonic()
            for i, w in enumerate(self.workers):
                if w.held and now - w.last_heard > self.spec.handoff_timeout_s:
                    raise RunFailed(f"rollout worker {i} sent nothing for {now - w.last_heard:.1f} s while holding "
                                    f"{len(w.held)} group(s) (async.handoff_timeout_s={self.spec.handoff_timeout_s:g})")
        return group

    def next_batch(self, learner_version: int) -> list[Trajectory]:
        if not self.workers:  # start on the first request, after any load_state
            if self.publisher is not None:  # the servers start from the learner's weights, whatever they loaded
                self.publisher.publish(sync_state_dict(self._model), int(self.version.value))
            self.workers = [self._spawn(i) for i in range(self.num_workers)]
            self._admit()
        if self._failure is not None:
            raise RunFailed(self._failure)
        if self.sampling is not None:
            return self._filled_batch(learner_version)
        batch: list[Trajectory] = []
        kept = 0
        while kept < self.P:
            group = self._receive()
            if self.controller.keep(group, learner_version):
                self._taken.append(group)
                batch.extend(group)
                kept += 1
                self.tally.add(group, "trained")
            else:
                self.tally.add(group, "dropped")
                self._admit()  # the drop freed admission capacity
            self._order.pop()
        self._batch_metrics = self.tally.take()
        return batch

    def _filled_batch(self, learner_version: int) -> list[Trajectory]:
        """``next_batch`` under dynamic sampling: groups within the bound are judged as they arrive; one without
        signal frees its capacity for a new group, until the step has P informative groups or hit the cap."""
        fill = self.sampling.fill()
        while not fill.done:
            group = self._receive()
            if not self.controller.keep(group, learner_version):
                self.tally.add(group, "dropped")
                self._admit()  # the drop freed admission capacity
            elif fill.offer(group):
                self._taken.append(group)
            else:
                self.controller.release()
                self._admit()
            self._order.pop()
        groups, filter_metrics = fill.result()
        self._taken = list(groups)  # at the cap, with the fillers
        self.controller.reclaim(fill.reclaimed)
        fill.record(self.tally)
        self._batch_metrics = filter_metrics | self.tally.take()
        return [t for g in groups for t in g]

    def _lock(self, i: int) -> Any:
        """Acquire worker i's weight lock; a worker that died holding it is replaced, one that holds it past
        the handoff timeout is killed and replaced. None if it could not be replaced (no restart left)."""
        deadline = time.monotonic() + self.spec.handoff_timeout_s
        while not self.workers[i].lock.acquire(timeout=_POLL_S):
            worker = self.workers[i]
            if worker.process.is_alive() and time.monotonic() < deadline:
                continue
            if worker.process.is_alive():  # stalled: killed, its pipe then ends too
                worker.error = f"held its weight lock past async.handoff_timeout_s={self.spec.handoff_timeout_s:g}"
                worker.process.kill()
            if self._bury(worker, defer=True) is None:
                return None
            deadline = time.monotonic() + self.spec.handoff_timeout_s
        return self.workers[i].lock

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Copy the new weights into shared memory under every worker's lock (or publish them to the servers),
        then admit what the bound allows. The batch just trained is no longer the source's to keep."""
        self._taken = []
        if self.publisher is not None:
            t0 = time.perf_counter()
            self.publisher.publish(sync_state_dict(model), version)  # every server paused, updated, resumed
            self.publish_s = time.perf_counter() - t0
            self.version.value = version
            self.controller.set_version(version)
            if self.workers and self._failure is None:
                self._admit()
            return
        locked = []
        try:
            for i in range(len(self.workers)):
                if (lock := self._lock(i)) is not None:
                    locked.append(lock)
            with torch.no_grad():
                for k, v in sync_state_dict(model).items():
                    self.shared[k].copy_(v)
            self.version.value = version
        finally:
            for lock in locked:
                lock.release()
        self.controller.set_version(version)
        if self.workers and self._failure is None:
            self._admit()

    def set_bound(self, k: int) -> None:
        """The bound from now on; the next ``publish`` admits what it allows (vcpo.orchestration.staleness)."""
        self.controller.set_bound(k)

    def metrics(self) -> dict[str, float]:
        s = self.controller.stats
        out = {"staleness/dropped_over_bound": float(s.dropped_over_bound + self._before.get("dropped_over_bound", 0)),
               "staleness/dropped_alpha": float(s.dropped_alpha + self._before.get("dropped_alpha", 0)),
               "async/worker_restarts": float(self.restarts + self._before.get("worker_restarts", 0))}
        if s.dropped_agent:
            out["agent/dropped_groups"] = float(s.dropped_agent)
        out |= self._batch_metrics
        if self.publisher is not None:  # the last update of the servers (as the Ray backend reports it)
            out["time/weight_publish_s"] = self.publish_s
        return out

    def _drain(self) -> None:
        """Move every group the workers have sent already into the order, without waiting for more."""
        for w in self.workers:
            try:
                while not w.results.closed and w.results.poll(0) and self._take(w):
                    pass
            except (OSError, EOFError):  # a dead worker: what it held is re-issued on resume
                pass

    def state(self) -> dict[str, Any]:
        """The stream cursor, the running totals, and every admitted group not yet trained: ``queued`` (finished,
        each group's trajectories with their tokens, log-probs and versions, in the order a step would take them:
        arrival, or ascending index in admission order) and ``requeued`` (the indices still being generated, or never
        started: regenerated first after a resume). A step in progress (a signal or an error ended it before its
        update) gives its groups back, ahead of the others."""
        self._drain()
        m = self.metrics()
        held = held_groups_state([*self._taken, *self._order.groups()],
                                 {*self._reissue, *(i for w in self.workers for i in w.held)})
        return {"next_group": self.next_group, "dropped_over_bound": int(m["staleness/dropped_over_bound"]),
                "dropped_alpha": int(m["staleness/dropped_alpha"]),
                "worker_restarts": int(m["async/worker_restarts"])} | held

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue a run: its next group index, its running totals (the restart budget is per process) and the
        groups it had admitted but not trained. Those count as admitted (the staleness bound's capacity); the finished
        ones are trained first, or dropped and counted at batch time when they lag beyond the bound, as any group is;
        the unfinished ones are generated again, before any new group. In admission order a step takes all of them,
        finished or not, by ascending index before any new group (a checkpoint of either order resumes in either).
        A checkpoint without them (older vcpo) resumes at ``next_group``, so the groups it had admitted are not
        trained."""
        self.next_group = int(state.get("next_group", self.next_group))
        self._before = {k: int(state.get(k, 0)) for k in ("dropped_over_bound", "dropped_alpha", "worker_restarts")}
        queued, self._reissue = held_groups(state)
        self._order = make_order(self.batch_order, self.next_group,
                                 pending=[*(group[0].group_id for group in queued), *self._reissue])
        for group in queued:
            self._order.put(group)
        self.controller.stats.admitted += len(queued) + len(self._reissue)

    def close(self) -> None:
        """Close every worker's pipes (it exits at end-of-file), wait a little, then kill what is left."""
        for w in self.workers:
            w.tickets.close()
            w.results.close()
        deadline = time.monotonic() + _CLOSE_GRACE_S
        for w in self.workers:
            w.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join(timeout=_CLOSE_GRACE_S)
        self.workers = []
