"""The sandboxed scoring pool: long-lived jailed workers that import the scoring libraries once and score batches
of ``(scorer, args, completion)`` requests, with a hard wall-clock deadline per item enforced by this (parent)
process. Untrusted completions are never scored in the caller's process.

A worker whose item passes its deadline has its whole process tree killed; the item scores 0 as ``timeout``, the
worker is started again and the rest of its batch goes on. A scorer that raises scores 0 as ``error``, a scoring
process that dies as ``crash``. Safe from any thread and from many at once (no signals, no main-thread tricks).
"""

from __future__ import annotations

import atexit
import itertools
import os
import select
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from queue import SimpleQueue
from typing import Any

from vcpo.envs.isolation import JailedProcess, Limits
from vcpo.rewards.protocol import ANSWER_MAX_BYTES, decode_answer, encode_frame, setup_key

STATUSES = ("ok", "error", "crash", "timeout")
MAX_COMPLETION_CHARS = 16_384  # longer completions are scored on their last this-many characters
STARTUP_TIMEOUT_S = 120.0  # starting a worker, or importing a scorer's libraries in it, on a loaded 2-core machine
Answer = tuple[float, str]  # (reward, status) as a worker sent it
CPU_S_PER_ITEM = 60  # RLIMIT_CPU backstop of a scoring process, per item; the wall deadline is the real limit


class RewardPoolError(RuntimeError):
    """The pool could not start a worker (an environment problem, never a completion's doing)."""


@dataclass(frozen=True)
class ScoreRequest:
    """One completion to score: ``scorers.SCORERS[scorer](completion, *setup, *args)`` in a worker.

    ``setup`` is what the scorer builds once per worker (e.g. a reasoning-gym dataset's name and settings);
    it is prepared before the completion's deadline starts. ``args`` are this item's own (e.g. its answer).
    """

    scorer: str
    args: tuple
    completion: str
    setup: tuple = ()


@dataclass(frozen=True)
class RewardOutcome:
    """A reward and how it came about: ``ok``, ``error`` (the scorer raised), ``crash`` (its process died) or
    ``timeout`` (killed at the deadline). Anything but ``ok`` has reward 0.0."""

    reward: float
    status: str = "ok"


class _Worker:
    """One jailed worker process tree, restarted after a timeout or crash; used by one thread at a time."""

    def __init__(self, limits: Limits, namespaces: bool) -> None:
        self.limits, self.namespaces = limits, namespaces
        self.jail: JailedProcess | None = None
        self.buffer = b""
        self.isolation: tuple[str, ...] = ()
        self.prepared: set[str] = set()

    def start(self) -> None:
        read_paths = tuple(p for p in sys.path if p)  # the worker imports vcpo and the scoring libraries
        payload = {"kind": "call", "target": "vcpo.rewards.worker:serve", "args": {"cpu_s_per_item": CPU_S_PER_ITEM}}
        jail = JailedProcess(payload, self.limits, namespaces=self.namespaces, read_paths=read_paths,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        report = jail.wait_report(STARTUP_TIMEOUT_S)
        if report is None or "error" in report:
            jail.close()
            why = (report or {}).get("error", f"no sign of life within {STARTUP_TIMEOUT_S:.0f} s")
            raise RewardPoolError(f"reward pool: a scoring worker failed to start: {why}")
        os.set_blocking(jail.proc.stdin.fileno(), False)
        self.jail, self.buffer, self.isolation = jail, b"", tuple(report.get("isolation", ()))
        self.prepared = set()

    def stop(self) -> None:
        if self.jail is not None:
            self.jail.close()
            self.jail = None

    def score(self, requests: list[ScoreRequest], timeout_s: float) -> list[RewardOutcome]:
        out: list[RewardOutcome] = []
        while len(out) < len(requests):
            if self.jail is None:
                self.start()
            rest = requests[len(out):]
            self.prepare(rest)
            items = [(r.scorer, r.setup, r.args, r.completion[-MAX_COMPLETION_CHARS:]) for r in rest]
            answered, failure = self._exchange(encode_frame("score", items), len(items), timeout_s)
            out += [RewardOutcome(*a) for a in answered]
            if failure is not None:  # the item after the answered ones: kill the tree, go on with a new one
                out.append(RewardOutcome(0.0, failure))
                self.stop()
        return out

    def prepare(self, requests: list[ScoreRequest]) -> None:
        """Have the worker build the scorer setups it lacks, under the start-up deadline, not the items'."""
        todo = {setup_key(r.scorer, r.setup): (r.scorer, r.setup) for r in requests}
        todo = {k: v for k, v in todo.items() if k not in self.prepared}
        if not todo:
            return
        _, failure = self._exchange(encode_frame("prepare", list(todo.values())), 1, STARTUP_TIMEOUT_S)
        if failure is not None:
            self.stop()
            raise RewardPoolError(f"reward pool: a worker could not prepare {sorted({v[0] for v in todo.values()})}"
                                  f" ({failure} within {STARTUP_TIMEOUT_S:.0f} s)")
        self.prepared |= todo.keys()  # a setup that failed makes its items report errors themselves

    def _exchange(self, frame_bytes: bytes, expected: int, timeout_s: float) -> tuple[list[Answer], str | None]:
        """Send one frame; collect ``expected`` answers in order, each within ``timeout_s`` of the one before."""
        frame = memoryview(frame_bytes)
        stdin, stdout = self.jail.proc.stdin.fileno(), self.jail.proc.stdout.fileno()
        poller = select.poll()
        poller.register(stdout, select.POLLIN)
        poller.register(stdin, select.POLLOUT)
        answered: list[Answer] = []
        deadline = time.monotonic() + timeout_s
        while len(answered) < expected:
            if b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                answered.append(decode_answer(line, ("ok", "error", "crash")))
                deadline = time.monotonic() + timeout_s
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return answered, "timeout"
            for fd, _ in poller.poll(remaining * 1000):
                if fd == stdin:
                    try:
                        frame = frame[os.write(stdin, frame[: 1 << 16]):]
                    except BrokenPipeError:
                        return answered, "crash"
                    if not frame:
                        poller.unregister(stdin)
                    continue
                chunk = os.read(stdout, 1 << 16)
                if not chunk or len(self.buffer) > ANSWER_MAX_BYTES * expected:
                    return answered, "crash"
                self.buffer += chunk
        return answered, None


class ScoringPool:
    """``workers`` sandboxed scoring processes (started on first use) behind a thread-safe ``score``.

    ``memory_mb`` is each worker's address-space allowance beyond the libraries it loaded; ``namespaces=False``
    gives the fallback isolation of docs/sandbox.md.
    """

    def __init__(self, workers: int = 2, memory_mb: int = 1024, namespaces: bool = True) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an integer >= 1 (got {workers!r})")
        self.workers = workers
        limits = Limits(memory_mb=memory_mb, max_processes=32)
        self._all = [_Worker(limits, namespaces) for _ in range(workers)]
        self._idle: SimpleQueue[_Worker] = SimpleQueue()
        for worker in self._all:
            self._idle.put(worker)
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="vcpo-reward")  # long-lived: see _run
        # Replacements of workers killed at a deadline start on a thread of their own: on the executor's threads they
        # could queue behind jobs that wait for an idle worker, which only the replacement provides (a deadlock).
        self._reviver = ThreadPoolExecutor(1, thread_name_prefix="vcpo-reward-revive")
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._setups: dict[str, ScoreRequest] = {}  # every scorer setup asked for: each worker prepares them all
        self._started = False
        self.closed = False

    def score(self, requests: list[ScoreRequest], timeout_s: float = 5.0) -> list[RewardOutcome]:
        """Score every request (in order); each has ``timeout_s`` of wall time once its worker reaches it.

        A batch is split into one contiguous chunk per worker, each sent in one round trip.
        """
        if self.closed:
            raise RewardPoolError("reward pool: used after close()")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 (got {timeout_s!r})")
        if not requests:
            return []
        n = min(self.workers, len(requests))
        bounds = [len(requests) * i // n for i in range(n + 1)]
        futures = [self._executor.submit(self._run, requests[a:b], timeout_s) for a, b in itertools.pairwise(bounds)]
        self.warm_up(requests)  # queued after the chunks: the workers they leave idle get ready meanwhile
        outcomes = [o for f in futures for o in f.result()]
        with self._lock:
            self._counts.update(o.status for o in outcomes)
        return outcomes

    def warm_up(self, requests: list[ScoreRequest]) -> None:
        """Start every worker and prepare the scorer setups of ``requests`` in each, in the background (returns at
        once), so that later batches find them ready. Failures surface at the next ``score``."""
        with self._lock:
            new = {k: ScoreRequest(r.scorer, (), "", r.setup)
                   for k, r in ((setup_key(r.scorer, r.setup), r) for r in requests) if k not in self._setups}
            self._setups.update(new)
            first_use, self._started = not self._started, True
        if new or first_use:
            for _ in self._all:
                self._executor.submit(self._run, list(self._setups.values()), None)

    def _run(self, requests: list[ScoreRequest], timeout_s: float | None) -> list[RewardOutcome]:
        # Runs on the pool's own threads: a worker's parent-death signal follows the thread that started it, so
        # workers are started only from these threads, which live as long as the pool. timeout_s None: warm up.
        worker = self._idle.get()
        try:
            if timeout_s is None:
                if worker.jail is None:
                    worker.start()
                worker.prepare(requests)
                return []
            return worker.score(requests, timeout_s)
        finally:
            self._release(worker)

    def _release(self, worker: _Worker) -> None:
        if worker.jail is None and not self.closed:  # killed at a deadline: start its replacement right away
            try:
                self._reviver.submit(self._revive, worker)
                return
            except RuntimeError:  # the pool is shutting down
                pass
        self._idle.put(worker)

    def _revive(self, worker: _Worker) -> None:
        try:
            worker.start()
            worker.prepare(list(self._setups.values()))
        finally:  # a failed start surfaces at the next score(), which tries again
            self._idle.put(worker)

    def counts(self) -> dict[str, int]:
        """How many items ended in each status since the pool started."""
        with self._lock:
            return {status: self._counts[status] for status in STATUSES}

    def close(self) -> None:
        """Stop every worker (their trees die with them); idempotent."""
        if self.closed:
            return
        self.closed = True
        self._executor.shutdown(wait=True)  # its jobs may wait for a replacement: the reviver stops after them
        self._reviver.shutdown(wait=True)
        for worker in self._all:
            worker.stop()


_shared: dict[tuple[Any, ...], ScoringPool] = {}
_shared_lock = threading.Lock()


def shared_pool(workers: int = 2, memory_mb: int = 1024) -> ScoringPool:
    """The process-wide pool of these settings, created on first use (a forked child gets its own)."""
    key = (os.getpid(), workers, memory_mb)
    with _shared_lock:
        pool = _shared.get(key)
        if pool is None or pool.closed:
            pool = _shared[key] = ScoringPool(workers, memory_mb)
        return pool


@atexit.register
def close_shared_pools() -> None:
    with _shared_lock:
        for key, pool in list(_shared.items()):
            if key[0] == os.getpid():
                pool.close()
        _shared.clear()
