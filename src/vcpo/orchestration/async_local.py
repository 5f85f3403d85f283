"""True asynchrony on one machine: rollout worker processes overlap with the learner.

Weights travel through shared memory (one shared copy of the state dict, a version counter and
a lock); each worker polls the version before every decode step when in-flight updates are on,
else before each request. The learner's process admits rollout groups under the staleness bound
(vcpo.orchestration.staleness) and drops, at batch time, any group that would exceed it.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.multiprocessing as mp

from vcpo.orchestration.base import ProblemStream, generator_for
from vcpo.orchestration.staleness import StalenessController
from vcpo.runtime import configure_cpu
from vcpo.types import SamplingParams, Trajectory

_POLL_S = 0.05


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
    task_options: dict[str, Any] = field(default_factory=dict)  # the rest of TaskConfig (prompt format, reward)


def rollout_worker(spec: WorkerSpec, shared: dict[str, torch.Tensor], version, lock, tickets, results, stop) -> None:
    """Worker loop: take admitted group indices, generate with the newest weights, send groups back."""
    configure_cpu(spec.torch_threads)  # as in the learner's process
    from transformers.utils import logging as hf_logging

    from vcpo.config import TaskConfig
    from vcpo.models.loading import load_policy
    from vcpo.rollout.collect import collect_groups
    from vcpo.rollout.engine import HFRolloutEngine
    from vcpo.tasks import make_task, prepare_scoring

    hf_logging.disable_progress_bar()
    task = make_task(TaskConfig(name=spec.task_name, kwargs=spec.task_kwargs, reward_timeout_s=spec.reward_timeout_s,
                                reward_workers=spec.reward_workers, **spec.task_options))
    prepare_scoring(task)  # the sandboxed scorer starts while the model loads
    model, tokenizer = load_policy(spec.model_path, spec.dtype, spec.device)
    engine = HFRolloutEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, version=-1,
                             lm_head_fp32=spec.lm_head_fp32)
    stream = ProblemStream(task, spec.seed, spec.prompts_per_step)

    def poll() -> tuple[int, dict[str, torch.Tensor]] | None:
        if version.value == engine.version:
            return None
        with lock:
            return int(version.value), {k: v.clone() for k, v in shared.items()}

    while not stop.is_set():
        try:
            indices = [tickets.get(timeout=_POLL_S)]
        except queue.Empty:
            continue
        while len(indices) < spec.prompts_per_step:  # batch whatever else is admitted already
            try:
                indices.append(tickets.get_nowait())
            except queue.Empty:
                break
        update = poll()
        if update is not None:
            engine.load_weights(update[1], update[0])
        groups = collect_groups(
            engine, tokenizer, task, [stream.group(i) for i in indices], indices, spec.group_size,
            spec.sampling, generator_for(spec.seed, indices[0]),
            weight_poll=poll if spec.inflight_updates else None,
        )
        for group in groups:
            results.put(group)


class AsyncSource:
    """Rollout worker processes plus an admission thread in the learner's process."""

    def __init__(self, model: torch.nn.Module, spec: WorkerSpec, num_workers: int, max_staleness: int,
                 drop_older_than: float | None, start_version: int = 0) -> None:
        ctx = mp.get_context("spawn")
        self.P = spec.prompts_per_step
        # A host copy whatever the learner's device: workers copy from it onto theirs.
        self.shared = {k: v.detach().to("cpu", copy=True).share_memory_() for k, v in model.state_dict().items()}
        self.version = ctx.Value("q", start_version)
        self.lock = ctx.Lock()
        self.tickets, self.results, self.stop = ctx.Queue(), ctx.Queue(), ctx.Event()
        self.controller = StalenessController(max_staleness, self.P, drop_older_than)
        self.controller.set_version(start_version)
        self.controller.stats.admitted = start_version * self.P  # groups already consumed before a resume
        self.next_group = start_version * self.P
        self._closing = threading.Event()
        self._started = False
        self.workers = [
            ctx.Process(target=rollout_worker, daemon=True,
                        args=(WorkerSpec(**{**spec.__dict__, "worker_id": i}), self.shared, self.version,
                              self.lock, self.tickets, self.results, self.stop))
            for i in range(num_workers)
        ]
        self._admitter = threading.Thread(target=self._admit_loop, daemon=True)

    def _start(self) -> None:
        """Start workers and admission on the first request, after any ``load_state``."""
        self._started = True
        for w in self.workers:
            w.start()
        self._admitter.start()

    def _admit_loop(self) -> None:
        while not self._closing.is_set():
            if self.controller.wait_admit(timeout_s=_POLL_S) is not None:
                self.tickets.put(self.next_group)
                self.next_group += 1

    def next_batch(self, learner_version: int) -> list[Trajectory]:
        if not self._started:
            self._start()
        batch: list[Trajectory] = []
        kept = 0
        while kept < self.P:
            try:
                group = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [w for w in self.workers if not w.is_alive()]
                if dead:
                    raise RuntimeError(f"rollout worker exited with code {dead[0].exitcode}") from None
                continue
            if self.controller.keep(group, learner_version):
                batch.extend(group)
                kept += 1
        return batch

    def publish(self, model: torch.nn.Module, version: int) -> None:
        with self.lock, torch.no_grad():
            for k, v in model.state_dict().items():
                self.shared[k].copy_(v)
            self.version.value = version
        self.controller.set_version(version)

    def metrics(self) -> dict[str, float]:
        s = self.controller.stats
        return {"staleness/dropped_over_bound": float(s.dropped_over_bound),
                "staleness/dropped_alpha": float(s.dropped_alpha)}

    def state(self) -> dict[str, Any]:
        return {"next_group": self.next_group}

    def load_state(self, state: dict[str, Any]) -> None:
        self.next_group = int(state.get("next_group", self.next_group))

    def close(self) -> None:
        self._closing.set()
        self.stop.set()
        if not self._started:
            return
        self._admitter.join(timeout=2)
        for w in self.workers:
            w.join(timeout=5)
            if w.is_alive():
                w.terminate()
