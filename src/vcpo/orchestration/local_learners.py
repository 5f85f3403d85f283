"""The learner group on one machine without Ray: ``trainer.num_learners`` local processes, ranks of one
torch.distributed group (gloo on CPUs, NCCL on GPUs), behind the ``Learner`` interface the training loop uses.

The driver keeps a mirror of the policy (evaluation, rollouts, checkpoint files) whose trained tensors live in shared
memory (CUDA IPC for a model on a GPU). After each step the ranks publish into it: with ``trainer.sharding: fsdp``
every rank gathers one layer at a time and rank 0 copies it into the mirror (no rank holds a second whole copy);
unsharded, rank 0 copies its own weights. With fsdp the ranks also write and read their checkpoint shards themselves
(vcpo.train.sharding); unsharded, rank 0 gives the optimizer state, as the Ray group's ranks do.
"""

from __future__ import annotations

import copy
import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from vcpo.config import Config, config_from_dict
from vcpo.models.lora import sync_state_dict
from vcpo.orchestration.base import BackendError
from vcpo.types import Batch

COLLECTIVE_TIMEOUT_S = 900.0
"""How long a rank's collective waits on its peers before it fails (a lost peer, a rank stuck elsewhere)."""
_CLOSE_GRACE_S = 10.0


@dataclass(frozen=True)
class RankSpec:
    config_tree: dict
    model_path: str
    rank: int
    world_size: int
    port: int
    parent_pid: int


def rank_device(config: Config, rank: int) -> torch.device:
    """Rank ``rank``'s device: its own GPU (``cuda:rank``) when the model runs on CUDA, else the CPU."""
    from vcpo.runtime import resolve_device

    device = resolve_device(config.model.device)
    if device.type != "cuda":
        return device
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def _publish(learner: Any, mirror: dict[str, torch.Tensor], rank: int) -> None:
    """The ranks' new weights into the driver's mirror: layer by layer from a sharded model (every rank takes part in
    each gather; rank 0 copies), whole from rank 0's unsharded one."""
    from vcpo.train.sharding import ShardedLearner, gathered_layers

    if isinstance(learner, ShardedLearner):
        for layer in gathered_layers(learner.model):
            if rank == 0:
                for key, value in layer.items():
                    mirror[key].copy_(value)
    elif rank == 0:
        for key, value in sync_state_dict(learner.model).items():
            mirror[key].copy_(value)


def _build(spec: RankSpec, config: Config, mirror: dict[str, torch.Tensor]) -> Any:
    """This rank's learner, starting from the driver's trained tensors (the mirror)."""
    from vcpo.models.loading import load_policy
    from vcpo.models.lora import apply_lora_config
    from vcpo.train.data_parallel import DataParallelLearner
    from vcpo.train.sharding import ShardedLearner, build_sharded_model

    device = rank_device(config, spec.rank)
    if config.trainer.sharding == "fsdp":
        initial = {k: v.detach() for k, v in mirror.items()} if spec.rank == 0 else None
        return ShardedLearner(build_sharded_model(spec.model_path, config, device, initial), config)
    model = apply_lora_config(load_policy(spec.model_path, config.model.dtype, device)[0], config.model.lora)
    with torch.no_grad():
        state = model.state_dict()
        for key, value in mirror.items():
            state[key].copy_(value)
    return DataParallelLearner(model, config)


def learner_rank(spec: RankSpec, conn: Connection, mirror: dict[str, torch.Tensor]) -> None:
    """One rank's process: builds its learner, then answers the driver's requests until ``close``. Every answer is
    ``("ok", value)`` or ``("error", one line)``; a rank whose collective lost its peer fails after
    ``COLLECTIVE_TIMEOUT_S`` at most."""
    import torch.distributed as dist

    from vcpo.runtime import configure_cpu, die_with_parent
    from vcpo.train.data_parallel import init_process_group
    from vcpo.train.sharding import load_sharded, save_sharded

    die_with_parent(spec.parent_pid)
    # The driver decides when the run ends (it checkpoints through the ranks first); they end when it closes them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config = config_from_dict(spec.config_tree)
    configure_cpu(config.runtime.torch_threads)
    try:
        init_process_group(spec.rank, spec.world_size, "127.0.0.1", spec.port, COLLECTIVE_TIMEOUT_S)
        learner = _build(spec, config, mirror)
        conn.send(("ok", None))
        while True:
            request, *args = conn.recv()
            if request == "close":
                break
            if request == "step":
                batch, lr, version = args
                learner.lr, learner.version = lr, version
                metrics = learner.step(batch)
                t0 = time.perf_counter()
                _publish(learner, mirror, spec.rank)
                answer: Any = (metrics | {"time/weight_gather_s": time.perf_counter() - t0}, learner.skip_reason)
            elif request == "save":
                save_sharded(learner.model, learner.optimizer, args[0])
                answer = None
            elif request == "load":
                load_sharded(learner.model, learner.optimizer, args[0])
                _publish(learner, mirror, spec.rank)
                answer = None
            elif request == "state":
                answer = learner.optimizer.state_dict() if spec.rank == 0 else None
            else:  # "restore": the driver's weights (the mirror) and optimizer state, after an unsharded checkpoint
                with torch.no_grad():
                    state = learner.model.state_dict()
                    for key, value in mirror.items():
                        state[key].copy_(value)
                # A copy: the state arrived in shared memory, the same tensors on every rank, which each updates
                learner.optimizer.load_state_dict(copy.deepcopy(args[0]))
                answer = None
            conn.send(("ok", answer))
    except EOFError:  # the driver is gone
        pass
    except BaseException as exc:  # the driver reports it, naming this rank
        text = " ".join(str(exc).split())[:400]
        try:
            conn.send(("error", f"{type(exc).__name__}: {text}"))
        except OSError:
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _ShardedState:
    """What checkpoints see as ``learner.optimizer`` under ``trainer.sharding: fsdp``: the ranks write and read their
    own shards of the weights and AdamW's state (vcpo.train.checkpoint)."""

    def __init__(self, group: LocalLearnerGroup) -> None:
        self.group = group

    def save_sharded(self, path: Path) -> None:
        self.group.call("save", str(path), what="saving the sharded checkpoint")

    def load_sharded(self, path: Path) -> None:
        self.group.call("load", str(path), what="loading the sharded checkpoint")


class _RankZeroOptimizer:
    """What checkpoints see as ``learner.optimizer`` unsharded: every rank holds the same state, rank 0 gives it;
    ``load_state_dict`` is sent to every rank (with the mirror's weights) before the next step."""

    def __init__(self, group: LocalLearnerGroup) -> None:
        self.group = group

    def state_dict(self) -> dict[str, Any]:
        return self.group.call("state", what="reading the optimizer state")[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.group.call("restore", state, what="loading the checkpoint")


class LocalLearnerGroup:
    """``trainer.num_learners`` learner processes behind the ``Learner`` interface (``step``, ``version``, ``lr``,
    ``optimizer``, ``model``, ``device``, ``skip_reason``, ``close``); ``model`` is the driver's mirror."""

    def __init__(self, model: torch.nn.Module, config: Config, model_path: str) -> None:
        from vcpo.rollout.launch import free_port

        n = config.trainer.num_learners
        self.model, self.config = model, config
        self.device = next(model.parameters()).device
        self.version = 0
        self.lr = config.trainer.lr
        self.skip_reason: str | None = None
        self.down: str | None = None  # why the group failed, once it has
        self.optimizer = _ShardedState(self) if config.trainer.sharding == "fsdp" else _RankZeroOptimizer(self)
        self.mirror = sync_state_dict(model)
        for tensor in self.mirror.values():
            if tensor.device.type == "cpu":
                tensor.share_memory_()  # in place: the mirror's parameters themselves
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns: list[Connection] = []
        self.processes: list[Any] = []
        for rank in range(n):
            parent, child = ctx.Pipe()
            spec = RankSpec(config.to_dict(), model_path, rank, n, port, os.getpid())
            process = ctx.Process(target=learner_rank, args=(spec, child, self.mirror), daemon=True,
                                  name=f"vcpo-learner-{rank}")
            process.start()  # from the main thread: the rank's parent-death signal follows this thread
            child.close()
            self.conns.append(parent)
            self.processes.append(process)
        try:
            self.answers("starting the learner ranks")
        except BaseException:
            self.close()
            raise

    def answers(self, what: str) -> list[Any]:
        """Every rank's answer to the request just sent; the first error or death ends the wait, naming the rank, and
        leaves the group down (its other ranks may be stuck in a collective with the lost one)."""
        try:
            return self._answers(what)
        except BackendError as e:
            self.down = str(e)
            raise

    def _answers(self, what: str) -> list[Any]:
        pending = dict(enumerate(self.conns))
        values: list[Any] = [None] * len(self.conns)
        while pending:
            sentinels = {self.processes[r].sentinel: r for r in pending}
            for ready in wait([*pending.values(), *sentinels]):
                rank = sentinels.get(ready)
                if rank is None:
                    rank = next(r for r, conn in pending.items() if conn is ready)
                try:
                    status, value = self.conns[rank].recv()
                except (EOFError, OSError):
                    self.processes[rank].join(timeout=_CLOSE_GRACE_S)
                    raise BackendError(f"learner rank {rank} died during {what} (exit code "
                                       f"{self.processes[rank].exitcode})") from None
                if status == "error":
                    raise BackendError(f"learner rank {rank} failed during {what}: {value}")
                values[rank] = value
                pending.pop(rank, None)
        return values

    def call(self, request: str, *args: Any, what: str) -> list[Any]:
        if self.down is not None:
            raise BackendError(f"the learner group cannot do {what}: it is down ({self.down})")
        for conn in self.conns:
            try:
                conn.send((request, *args))
            except OSError:  # a rank that died since: its end-of-file or exit code names it below
                pass
        return self.answers(what)

    def step(self, batch: Batch) -> dict[str, float]:
        """One step of every rank on the global batch; the mirror then holds the new weights."""
        t0 = time.perf_counter()
        metrics, self.skip_reason = self.call("step", batch, self.lr, self.version,
                                              what=f"learner step {self.version + 1}")[0]
        self.version += 1
        return metrics | {"time/learner_group_s": time.perf_counter() - t0}

    def close(self) -> None:
        """Stop every rank (asked first, killed after a grace period)."""
        for conn in self.conns:
            try:
                conn.send(("close",))
            except OSError:
                pass
        deadline = time.monotonic() + _CLOSE_GRACE_S
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self.conns:
            conn.close()
        self.conns, self.processes = [], []
