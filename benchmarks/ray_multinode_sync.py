"""Weight sync across Ray nodes: seconds per version for the object-store path and the broadcast path, against the
state size, with the receivers on other nodes than the sender, and on the sender's node for contrast.

Run by hand (figures in benchmarks/notes/issue28_raymn.md):
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ray_multinode_sync.py --sizes 1 4 16 64 --repeats 5 \\
        [--out benchmarks/ray_multinode]

A local multi-node cluster (vcpo.testing.ray_cluster: each node its own raylet and object store, on 127.0.0.1):
the head holds the sender (what learner rank 0 is), nodes a and b one receiver each (what rollout actors are). Per
version, as the backend does it:

- object store: the sender ``ray.put``s the state dict once; each receiver ``ray.get``s it (Ray copies it across
  object stores: node to node), timed from the put to the last receiver holding it;
- broadcast: the sender and the receivers form a gloo group of their own (``BroadcastMember``, the backend's class:
  one flat buffer per dtype), timed from the call to the last receiver holding it.

Every version is a fresh float32 state dict of 64 tensors filled with the version number; each receiver checks
every value (exact delivery). The same cells with both receivers on the head node give the same-node figures. On
one machine the "network" is loopback: what this measures is Ray's and gloo's per-byte work and node-to-node
copies, not a real network's bandwidth or latency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

TENSORS = 64


def state(megabytes: float, version: int) -> dict[str, torch.Tensor]:
    n = int(megabytes * 2**20) // 4 // TENSORS
    return {f"layer{i}": torch.full((n,), float(version)) for i in range(TENSORS)}


def member_class():
    import ray

    from vcpo.orchestration.ray.broadcast import BroadcastMember

    @ray.remote(num_cpus=0)
    class Member:
        """The sender (rank 0) or a receiver of one cell."""

        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def join(self, address: str, port: int, rank: int, world: int, layout) -> None:
            self.member = BroadcastMember(address, port, rank, world, 120, "gloo", layout)

        def send(self, megabytes: float, version: int) -> None:
            self.member.send(state(megabytes, version))

        def receive(self, version: int) -> bool:
            return all(bool((t == version).all()) for t in self.member.receive().values())

        def put(self, megabytes: float, version: int) -> list:
            return [ray.put(state(megabytes, version))]

        def fetch(self, refs: list, version: int) -> bool:
            return all(bool((t == version).all()) for t in ray.get(refs[0]).values())

    return Member


def cell(megabytes: float, placement: str, repeats: int) -> dict:
    """Seconds per version (median and min of ``repeats``) of both paths for one size and placement."""
    import ray

    from vcpo.orchestration.ray.broadcast import broadcast_layout, free_endpoint

    member = member_class()
    receivers = ("wa", "wb") if placement == "other_nodes" else ("h", "h")
    sender = member.options(resources={"h": 1}).remote()
    members = [sender] + [member.options(resources={r: 1}).remote() for r in receivers]
    nodes = ray.get([m.node.remote() for m in members])
    layout = broadcast_layout(state(megabytes, 0))
    address, port = ray.get(ray.remote(num_cpus=0, resources={"h": 1})(free_endpoint).remote())
    ray.get([m.join.remote(address, port, rank, len(members), layout) for rank, m in enumerate(members)])
    store, broadcast = [], []
    for version in range(1, repeats + 2):  # the first version of each path warms it up and is left out
        t0 = time.perf_counter()
        refs = ray.get(sender.put.remote(megabytes, version))
        assert all(ray.get([m.fetch.remote(refs, version) for m in members[1:]]))
        store.append(time.perf_counter() - t0)
        del refs
        t0 = time.perf_counter()
        done = ray.get([sender.send.remote(megabytes, version)] + [m.receive.remote(version) for m in members[1:]])
        assert all(done[1:])
        broadcast.append(time.perf_counter() - t0)
    for m in members:
        ray.kill(m)
    sent = len(nodes) - 1
    return {"megabytes": megabytes, "placement": placement, "receivers": sent,
            "receiver_nodes_other_than_sender": sum(n != nodes[0] for n in nodes[1:]),
            "object_store_s_median": statistics.median(store[1:]), "object_store_s_min": min(store[1:]),
            "broadcast_s_median": statistics.median(broadcast[1:]), "broadcast_s_min": min(broadcast[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16, 64], help="state dict sizes, MB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from vcpo.testing.ray_cluster import local_cluster

    store_mb = int(max(args.sizes) * 4 + 64)  # a few versions in flight per node
    results = {"load_avg_start": os.getloadavg()[0], "cpus": os.cpu_count(), "object_store_mb_per_node": store_mb,
               "cells": []}
    with local_cluster(head={"h": 10}, head_cpus=1, object_store_mb=store_mb) as cluster:
        cluster.add({"wa": 1})
        cluster.add({"wb": 1})
        for megabytes in args.sizes:
            for placement in ("other_nodes", "same_node"):
                results["cells"].append(cell(megabytes, placement, args.repeats))
                print(json.dumps(results["cells"][-1]), flush=True)
    results["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(results, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
