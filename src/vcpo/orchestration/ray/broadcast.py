"""Weight broadcast for Ray's in-process rollout actors (``ray.weight_sync: broadcast``): a process group of its own
(its own TCPStore, never the learners' default group) of learner rank 0 and every rollout actor, in which rank 0
broadcasts each new version, one flat buffer per dtype; NCCL when every member is on CUDA, gloo otherwise."""

from __future__ import annotations

import datetime
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch import Tensor

from vcpo.orchestration.base import BackendError
from vcpo.orchestration.ray.session import RemoteFailed, error_line, gather
from vcpo.rollout.weights import distinct_tensors


def free_endpoint() -> tuple[str, int]:
    """This node's address and a free port (the master of a TCPStore binds it)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


Layout = list[tuple[str, torch.Size, torch.dtype]]


def broadcast_layout(state_dict: dict[str, Tensor]) -> Layout:
    """What rank 0 sends, in order: ``state_dict``'s distinct tensors. An alias (tied embeddings) is left out: the
    receiving engine fills it from the tensor it shares (``HFRolloutEngine.load_weights``)."""
    return [(key, value.shape, value.dtype) for key, value in distinct_tensors(state_dict)]


class BroadcastMember:
    """One member of the weight-broadcast group: rank 0 (a learner) sends, ranks 1.. (rollout actors) receive.

    Every member holds rank 0's ``layout``; the tensors travel packed per dtype into one flat buffer each, in order of
    first appearance. Every collective ends with an error after ``timeout_s``."""

    def __init__(self, address: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str,
                 layout: Layout) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.store = dist.TCPStore(address, port, world_size, rank == 0, timeout)
        store = dist.PrefixStore("vcpo-weights", self.store)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self.layout = layout
        self.dtypes = list(dict.fromkeys(dtype for _, _, dtype in layout))

    def _broadcast(self, flats: list[Tensor]) -> None:
        for flat in flats:
            self.group.broadcast(flat, 0).wait()

    def send(self, state_dict: dict[str, Tensor]) -> None:
        """Rank 0: broadcast the layout's tensors of ``state_dict``."""
        with torch.no_grad():
            flats = [torch.cat([state_dict[key].detach().reshape(-1).to(self.device)
                                for key, _, d in self.layout if d == dtype]) for dtype in self.dtypes]
        self._broadcast(flats)

    def receive(self) -> dict[str, Tensor]:
        """Ranks 1..: the broadcast state dict, views into fresh flat buffers (a copy the caller may keep while the
        next version is received)."""
        flats = [torch.empty(sum(shape.numel() for _, shape, d in self.layout if d == dtype), dtype=dtype,
                             device=self.device) for dtype in self.dtypes]
        self._broadcast(flats)
        out, offsets = {}, dict.fromkeys(self.dtypes, 0)
        for key, shape, dtype in self.layout:
            flat, at = flats[self.dtypes.index(dtype)], offsets[dtype]
            out[key] = flat[at : at + shape.numel()].view(shape)
            offsets[dtype] = at + shape.numel()
        return out


@dataclass(frozen=True)
class Failed:
    """A member's collective that failed, with its one-line reason."""

    reason: str


def attempt(fn, *args) -> Failed | None:
    """Run a member's part of a collective in its actor: None, or why it failed (answered, not raised: the driver may
    have stopped waiting on that member, and a raised error nobody reads would be logged by Ray)."""
    try:
        fn(*args)
    except RuntimeError as exc:  # torch.distributed's errors (a closed peer, a timeout) are RuntimeErrors
        return Failed(error_line(exc))
    return None


class WeightBroadcast:
    """The driver's side: forms the group of ``sender`` (learner rank 0) and the rollout actors, broadcasts each
    version, and forms the group again after an actor restart or a failed broadcast. A version it does not deliver
    (group broken, being formed again, an actor restarting) reaches the actors through the object store, which holds
    every version anyway. After a failure it waits ``timeout_s`` before forming a new group (members still blocked in
    the old one's collective are free by then); after ``MAX_FAILED_FORMATIONS`` failed formations it stays off.

    ``stats``: ``ray/broadcast_groups`` (groups formed), ``ray/broadcast_fallbacks`` (versions the actors took from
    the object store instead)."""

    MAX_FAILED_FORMATIONS = 3

    def __init__(self, sender: Any, timeout_s: float) -> None:
        self.sender, self.timeout_s = sender, timeout_s
        self.formed_for: list[int] | None = None  # the actors' lives the current group was formed with
        self.failed_at = -float("inf")
        self.failed_formations = 0
        self.stats = {"ray/broadcast_groups": 0.0, "ray/broadcast_fallbacks": 0.0}

    def _wait(self, refs: list, what: str) -> list:
        """Every member's answer; the first member to fail ends the wait at once, not at the deadline."""
        try:
            return gather(refs, self.timeout_s, what, refuse=lambda a: a.reason if isinstance(a, Failed) else None)
        except RemoteFailed as failed:
            error = getattr(failed.error, "cause", None) or failed.error  # a task's own error, not Ray's wrapper
            raise BackendError(f"{what} failed: {error_line(error)}") from None

    def _form(self, actors: list, lives: list[int]) -> None:
        (device, layout), *devices = self._wait(
            [self.sender.broadcast_plan.remote()] + [a.sync_device.remote() for a in actors],
            "asking the weight-broadcast group's devices")
        backend = "nccl" if device == "cuda" and all(d == "cuda" for d in devices) else "gloo"
        address, port = self._wait([self.sender.rendezvous.remote()], "learner rank 0 (broadcast rendezvous)")[0]
        n = len(actors) + 1
        self._wait([self.sender.join_broadcast.remote(address, port, n, backend, layout)]
                   + [a.join_broadcast.remote(address, port, i + 1, n, backend, layout) for i, a in enumerate(actors)],
                   f"forming the weight-broadcast group ({backend}, {n} members)")
        self.formed_for = list(lives)
        self.stats["ray/broadcast_groups"] += 1

    def send(self, actors: list, lives: list[int], version: int, restarting: bool) -> float | None:
        """Broadcast ``version`` (rank 0's weights now) to every actor; the seconds it took, or None when it was not
        delivered (the actors then take it from the object store)."""
        if self.formed_for != lives and not self._can_form(restarting):
            self.stats["ray/broadcast_fallbacks"] += 1
            return None
        if self.formed_for != lives:
            try:
                self._form(actors, lives)
            except BackendError as exc:
                self._failed(exc, formation=True)
                return None
        t0 = time.perf_counter()
        try:
            self._wait([self.sender.broadcast_weights.remote()] + [a.receive_weights.remote(version) for a in actors],
                       f"the weight broadcast of version {version}")
        except BackendError as exc:
            self._failed(exc, formation=False)
            return None
        return time.perf_counter() - t0

    def _can_form(self, restarting: bool) -> bool:
        return (not restarting and self.failed_formations < self.MAX_FAILED_FORMATIONS
                and time.monotonic() - self.failed_at >= self.timeout_s)

    def _failed(self, exc: BackendError, formation: bool) -> None:
        self.formed_for, self.failed_at = None, time.monotonic()
        self.failed_formations += formation
        self.stats["ray/broadcast_fallbacks"] += 1
        off = self.failed_formations >= self.MAX_FAILED_FORMATIONS
        print(f"warning: {exc}; the object store carries the weights "
              f"{'for the rest of the run' if off else 'until the group is formed again'}", file=sys.stderr, flush=True)
