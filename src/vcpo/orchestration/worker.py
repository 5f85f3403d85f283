"""A rollout worker process: rebuilds its engine, task and problem stream from a ``WorkerSpec``, then turns
the group indices the learner admits into scored groups, generated with the newest published weights.

It talks to the learner only through two pipes of its own (tickets in, groups out) and one lock of its own
around the shared weights, so that a worker killed at any moment leaves no shared lock held and no queue
half-written for the others; it dies with the trainer however the trainer dies.
"""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from vcpo.models.files import one_line
from vcpo.orchestration.base import ProblemStream, generator_for
from vcpo.runtime import configure_cpu, die_with_parent
from vcpo.types import SamplingParams


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to rebuild its engine, task and problem stream."""

    worker_id: int
    model_path: str
    dtype: str
    device: str
    lm_head_fp32: bool
    task_name: str
    task_kwargs: dict[str, Any]
    seed: int
    prompts_per_step: int
    group_size: int
    sampling: SamplingParams
    inflight_updates: bool
    torch_threads: int = 1
    reward_timeout_s: float = 5.0
    reward_workers: int = 1
    parent_pid: int = 0
    """The trainer's pid: the worker exits when that process is gone."""
    handoff_timeout_s: float = 300.0
    server: dict[str, Any] | None = None
    """rollout.server when rollout.engine is server: the worker is an HTTP client and loads only the tokenizer."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """The rest of the run's TaskConfig (prompt format, system prompt, instruction, reward)."""
    lora: dict[str, Any] | None = None
    """model.lora when its rank is above 0: the engine gets the same adapters, and the learner sends only them."""


class _Sender:
    """Sends from a thread, so that a full pipe (the learner busy with its step) never stalls generation."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._outbox: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="vcpo-rollout-sender")
        self._thread.start()

    def put(self, kind: str, payload: Any) -> None:
        self._outbox.put((kind, payload))

    def _run(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except OSError:  # the learner closed its end (it is stopping, or gone)
                return

    def close(self) -> None:
        self._outbox.put(None)
        self._thread.join()


def rollout_worker(spec: WorkerSpec, shared: dict[str, torch.Tensor], version: Any, tickets: Connection,
                   results: Connection, lock: Any) -> None:
    """The worker's main function: serve tickets until the learner closes the ticket pipe.

    Signals are the trainer's to handle: SIGINT (Ctrl-C reaches the whole process group) and SIGTERM are
    ignored here, and the trainer closes its workers when it stops. Any error is reported to the learner
    as one line (``("error", text)``) before the process exits with status 1.
    """
    die_with_parent(spec.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sender = _Sender(results)
    try:
        _serve(spec, shared, version, tickets, lock, sender)
    except BaseException as e:
        sender.put("error", f"{type(e).__name__}: {one_line(e)}")
        sender.close()
        raise SystemExit(1) from None
    sender.close()


def build_worker(spec: WorkerSpec, version_of: Callable[[], int] | None = None):
    """A worker's engine (at version -1 until it receives weights), tokenizer, task and problem stream, built in the
    worker's own process (a local worker, or a Ray rollout actor: vcpo.orchestration.ray.rollout). With inference
    servers (``spec.server``), ``version_of`` reads the version the learner last published to them."""
    configure_cpu(spec.torch_threads)  # as in the learner's process
    from transformers.utils import logging as hf_logging

    from vcpo.config import TaskConfig
    from vcpo.models.loading import load_policy
    from vcpo.rollout.engine import HFRolloutEngine
    from vcpo.tasks import make_task, prepare_scoring

    hf_logging.disable_progress_bar()
    task = make_task(TaskConfig(name=spec.task_name, kwargs=spec.task_kwargs, reward_timeout_s=spec.reward_timeout_s,
                                reward_workers=spec.reward_workers, **spec.task_options))
    prepare_scoring(task)  # the sandboxed scorer starts while the model loads
    if spec.server is None:
        model, tokenizer = load_policy(spec.model_path, spec.dtype, spec.device)
        if spec.lora is not None:  # the base stays as loaded; the adapters come from the learner (version -1 now)
            from vcpo.models.lora import apply_lora_config

            model = apply_lora_config(model, spec.lora)
        engine = HFRolloutEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, version=-1,
                                 lm_head_fp32=spec.lm_head_fp32)
    else:  # the learner's process publishes the weights to the servers; vcpo serve tags each token's version
        from vcpo.config import ServerConfig
        from vcpo.models.loading import load_tokenizer
        from vcpo.rollout.server import server_engine

        if version_of is None:
            raise ValueError("a worker on inference servers needs version_of (the learner's published version)")
        tokenizer = load_tokenizer(spec.model_path)
        engine = server_engine(ServerConfig(**spec.server), version_of=version_of, lora=spec.lora is not None)
    return engine, tokenizer, task, ProblemStream(task, spec.seed, spec.prompts_per_step)


def _serve(spec: WorkerSpec, shared: dict[str, torch.Tensor], version: Any, tickets: Connection, lock: Any,
           sender: _Sender) -> None:
    from vcpo.rollout.collect import collect_groups

    engine, tokenizer, task, stream = build_worker(spec, version_of=lambda: int(version.value))

    def poll() -> tuple[int, dict[str, torch.Tensor]] | None:
        if spec.server is not None or version.value == engine.version:  # a lock-free hint; the copy is locked
            return None
        if not lock.acquire(timeout=spec.handoff_timeout_s):
            raise TimeoutError(f"the learner held worker {spec.worker_id}'s weight lock for more than "
                               f"{spec.handoff_timeout_s:g} s (async.handoff_timeout_s)")
        try:
            return int(version.value), {k: v.clone() for k, v in shared.items()}
        finally:
            lock.release()

    while True:
        try:
            indices = [tickets.recv()]
            while len(indices) < spec.prompts_per_step and tickets.poll():  # batch whatever is admitted already
                indices.append(tickets.recv())
        except EOFError:  # the learner closed the pipe: it is done with this worker
            return
        update = poll()
        if update is not None:
            engine.load_weights(update[1], update[0])
        groups = collect_groups(
            engine, tokenizer, task, [stream.group(i) for i in indices], indices, spec.group_size,
            spec.sampling, generator_for(spec.seed, indices[0]),
            weight_poll=poll if spec.inflight_updates else None,
        )
        for group in groups:
            sender.put("group", group)
