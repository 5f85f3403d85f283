"""A multi-node Ray cluster on one machine, for tests and benchmarks: ``ray.cluster_utils.Cluster``, each node a
real raylet with its own object store, every process bound to 127.0.0.1, and nothing left behind however the body
ends.

``with local_cluster(head={"learner": 1}) as cluster:`` starts the head node (the driver attaches to it, it cannot
be removed); ``cluster.add({"rollout": 2})`` adds a worker node, ``cluster.remove(node)`` kills one with its actors
(what a lost machine looks like to Ray). On the way out the driver disconnects, every node is removed, and every
process the cluster ever started (raylets, GCS, agents, actor workers; not the driver's processes of before, such
as a reward pool's workers) is gone: given 10 s to end by itself, then signalled (named in a ``ResourceWarning``);
one that outlives SIGKILL is named in a ``TimeoutError``. The driver's signal handlers are as they were."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vcpo.testing.faults import alive, descendants, wait_gone

MB = 1024 * 1024
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to 0, Ray takes 127.0.0.1 as this machine's address: a client given 127.0.0.1:PORT connects there instead
of the machine's external address (where a loopback-bound GCS does not listen)."""


FAST_HEALTH = {"health_check_period_ms": 500, "health_check_timeout_ms": 500, "health_check_failure_threshold": 4}
"""The GCS declares a silent node dead after about 2 s (Ray's default: 30 s), so that a removed node's actors are
restarted within a short test."""


class LocalCluster:
    """The running cluster: ``address`` (what ``ray.address`` joins), ``head``, ``add``, ``remove``."""

    def __init__(self, cluster: Any, object_store_mb: int, children_before: set[int]) -> None:
        self.cluster, self.object_store_mb = cluster, object_store_mb
        self.head = cluster.head_node
        self.address: str = cluster.address
        self.children_before = children_before  # the driver's own processes (a reward pool, a server)
        self.started: set[int] = set()  # every process seen under the cluster's processes since it started
        self.watch()

    def watch(self) -> None:
        """Record the processes now below the driver's children that the cluster started (a node's actor workers are
        not below them once their raylet is gone)."""
        for child in children(os.getpid()) - self.children_before:
            self.started |= {child, *descendants(child)}

    def add(self, resources: dict[str, float], num_cpus: int = 1) -> Any:
        node = self.cluster.add_node(num_cpus=num_cpus, resources=resources, **_node_args(self.object_store_mb))
        self.watch()
        return node

    def remove(self, node: Any) -> None:
        """Kill ``node``'s raylet, object store and workers at once (no graceful exit: a lost machine)."""
        self.watch()
        self.cluster.remove_node(node, allow_graceful=False)


def _node_args(object_store_mb: int) -> dict[str, Any]:
    return {"object_store_memory": object_store_mb * MB, "node_ip_address": "127.0.0.1"}


@contextmanager
def local_cluster(head: dict[str, float], head_cpus: int = 1, object_store_mb: int = 80) -> Iterator[LocalCluster]:
    """A head node with ``head`` custom resources and ``head_cpus`` CPUs, this process connected as the driver."""
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    before, constant = os.environ.get(LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER
    # The in-process head node and ray.init install SIGTERM handlers of their own, which outlive the shutdown.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    os.environ[LOOPBACK_ENV] = "0"  # inherited by the nodes and by every `vcpo` a test starts
    ray_constants.ENABLE_RAY_CLUSTER = False  # what the variable sets, in this process where Ray is imported already
    cluster = local = None
    children_before = children(os.getpid())
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": head_cpus, "resources": head, "include_dashboard": False, "_system_config": FAST_HEALTH,
            **_node_args(object_store_mb)})
        local = LocalCluster(cluster, object_store_mb, children_before)
        ray.init(address=cluster.address, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
        local.watch()
        yield local
    finally:
        ray.shutdown()
        if local is not None:
            local.watch()
        if cluster is not None:
            address = cluster.address
            cluster.shutdown()  # graceful: a raylet stopped so takes its agents with it
            _forget_address(address)
        ray_constants.ENABLE_RAY_CLUSTER = constant
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if before is None:
            os.environ.pop(LOOPBACK_ENV, None)
        else:
            os.environ[LOOPBACK_ENV] = before
    if local is not None:
        _reap(local.started)


def children(pid: int) -> set[int]:
    """The live direct children of ``pid`` (whichever of its threads started them)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found.update(int(c) for c in (task / "children").read_text().split())
    return {c for c in found if alive(c)}


def _reap(pids: set[int], grace_s: float = 10.0) -> None:
    """Wait ``grace_s`` for every process the cluster started to end by itself, then SIGTERM the ones left, then
    SIGKILL; a process that needed a signal is named in a ``ResourceWarning`` (on a loaded machine a Ray worker can
    take longer than the grace to notice its raylet is gone), one that outlives SIGKILL in a ``TimeoutError``."""
    try:
        wait_gone([p for p in pids if alive(p)], timeout_s=grace_s)
        return
    except TimeoutError:
        slow = [p for p in pids if alive(p)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in [p for p in slow if alive(p)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        with contextlib.suppress(TimeoutError):
            wait_gone([p for p in slow if alive(p)], timeout_s=10.0)
    left = [p for p in slow if alive(p)]
    if left:
        raise TimeoutError(f"Ray processes {left} outlived the cluster and SIGKILL") from None
    warnings.warn(f"Ray processes {slow} outlived the cluster by {grace_s:g} s and were signalled", ResourceWarning,
                  stacklevel=2)


def _forget_address(address: str | None) -> None:
    """Remove the address file Ray's Cluster wrote for ``ray.init(address="auto")``, if it still names ours."""
    from ray._private.utils import get_ray_address_file

    path = get_ray_address_file(None)
    try:
        with open(path) as f:
            if f.read().strip() == address:
                os.remove(path)
    except OSError:
        pass
