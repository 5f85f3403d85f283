"""Where the Ray backend's actors go (docs/ray.md, "Placement"): each rollout actor asks for
``ray.worker_num_cpus``/``worker_num_gpus`` plus ``ray.rollout_resources`` and is spread over the nodes that fit it
(``ray.rollout_scheduling``); the learner ranks are the bundles of one placement group (``ray.learner_num_cpus``/
``learner_num_gpus`` plus ``ray.learner_resources`` each, strategy ``ray.learner_placement``), reserved all at once
or not at all, so that a cluster that cannot hold every rank ends the run in one line instead of starting some."""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vcpo.config import RayConfig
from vcpo.orchestration.base import BackendError


def demand(num_cpus: float, num_gpus: float, custom: dict[str, float]) -> dict[str, float]:
    """One actor's resources as Ray counts them (zero amounts left out)."""
    return {k: v for k, v in {"CPU": num_cpus, "GPU": num_gpus, **custom}.items() if v > 0}


def describe(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def live_nodes() -> list[dict[str, float]]:
    """The total resources of every live node (what a node could hold when empty)."""
    return [dict(node["Resources"]) for node in ray.nodes() if node["Alive"]]


def _fits(need: dict[str, float], node: dict[str, float]) -> bool:
    return all(node.get(k, 0.0) >= v for k, v in need.items())


def cluster_shape() -> str:
    """The live nodes' CPU, GPU and custom resources, for error lines."""
    hidden = ("memory", "object_store_memory")
    return "; ".join(describe({k: v for k, v in n.items() if not k.startswith("node:") and k not in hidden})
                     for n in live_nodes()) or "none"


def rollout_options(rc: RayConfig) -> dict[str, Any]:
    """Ray options of every rollout actor; one line at once when no live node could ever hold one (a node started
    later, e.g. by an autoscaler, does not count)."""
    need = demand(rc.worker_num_cpus, rc.worker_num_gpus, rc.rollout_resources)
    if not any(_fits(need, node) for node in live_nodes()):
        raise BackendError(f"no node of the Ray cluster can hold a rollout actor ({describe(need)}: "
                           f"ray.worker_num_cpus/gpus, ray.rollout_resources); live nodes: {cluster_shape()}")
    return {"num_cpus": rc.worker_num_cpus, "num_gpus": rc.worker_num_gpus, "resources": dict(rc.rollout_resources),
            "scheduling_strategy": "SPREAD" if rc.rollout_scheduling == "spread" else "DEFAULT"}


class LearnerPlacement:
    """The learner group's placement group: ``n`` bundles (one per rank) reserved together within
    ``ray.start_timeout_s``, or a one-line ``BackendError`` naming the bundles and the cluster; ``options(rank)``
    are the rank's Ray options inside its bundle. Ranks that ask for nothing reserve nothing (no group)."""

    def __init__(self, rc: RayConfig, n: int) -> None:
        self.rc = rc
        self.bundle = demand(rc.learner_num_cpus, rc.learner_num_gpus, rc.learner_resources)
        self.group: PlacementGroup | None = None
        if not self.bundle:
            return
        strategy = rc.learner_placement.upper()
        self.group = placement_group([dict(self.bundle) for _ in range(n)], strategy=strategy)
        ready, _ = ray.wait([self.group.ready()], timeout=rc.start_timeout_s)
        if not ready:
            self.remove()
            raise BackendError(f"the learner group ({n} ranks of {describe(self.bundle)}, placement "
                               f"{rc.learner_placement}) did not fit the Ray cluster within "
                               f"ray.start_timeout_s={rc.start_timeout_s:g} s; live nodes: {cluster_shape()}")

    def options(self, rank: int) -> dict[str, Any]:
        rc = self.rc
        out: dict[str, Any] = {"num_cpus": rc.learner_num_cpus, "num_gpus": rc.learner_num_gpus,
                               "resources": dict(rc.learner_resources)}
        if self.group is not None:
            out["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank)
        return out

    def remove(self) -> None:
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None


def node_id() -> str:
    """The Ray node this process runs on (an actor's answer to ``node``)."""
    return ray.get_runtime_context().get_node_id()
