"""Steps per second of the Ray backend with 1 and 2 rollout actors and 1 and 2 learner ranks, the weight-sync time
per step, and the object store's put/get throughput (what the CPU fallback of weight sync costs per byte).

Run by hand (results in benchmarks/RESULTS.md):
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/ray_scaling.py --steps 12 [--out benchmarks/ray_scaling]
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/ray_scaling.py --servers 2 --rounds 2 --steps 12
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/ray_scaling.py --weight-sync --rounds 2 --steps 12

Each cell is one `vcpo train` (in this process) on one shared local Ray instance; the first 2 steps (actor start,
the first rollouts) are left out of the rates. The model is the embedded default without a warm start
(sft.steps=0): rollout and learner costs do not depend on what the model has learned. With ``--servers N`` the
cells are instead 2 rollout workers on N `vcpo serve` processes, the local backend against Ray, alternated for
``--rounds`` rounds: steps/s and ``time/weight_publish_s`` (write the safetensors directory, then pause, update and
resume every server). With ``--weight-sync`` the cells are 2 rollout actors and 1 learner with
``ray.weight_sync`` object_store against broadcast, alternated, then the raw throughput of both paths on a
``--store-mb`` state dict sent to 2 receiving actors.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vcpo.metrics import METRICS_FILE, read_metrics

CELLS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (rollout actors, learner ranks)


def timed_lines(run: Path, overrides: list[str], steps: int, root: Path) -> list[dict]:
    """One async run of ``steps`` steps; its metric lines past the first two."""
    from vcpo.config import load_config
    from vcpo.loop.trainer import train

    train(load_config("configs/quickstart.yaml", [
        f"run_dir={run}", f"sft.cache_dir={root / 'cache'}", "sft.steps=0", f"trainer.max_steps={steps}",
        "trainer.eval_every=0", "trainer.checkpoint_every=0", "task.eval_size=8", "logging.progress=false",
        "rollout.prompts_per_step=8", "rollout.group_size=4", "async.mode=async", "async.max_staleness=2",
        "async.inflight_updates=true", *overrides,
    ]))
    return read_metrics(run / METRICS_FILE)[2:]


def cell(workers: int, learners: int, steps: int, root: Path) -> dict[str, float]:
    lines = timed_lines(root / f"w{workers}_l{learners}", ["async.backend=ray", f"async.num_workers={workers}",
                                                           f"trainer.num_learners={learners}"], steps, root)
    step_s = [m["time/step_s"] for m in lines]
    return {
        "rollout_actors": workers, "learners": learners, "steps_timed": len(lines),
        "steps_per_s": len(step_s) / sum(step_s),
        "learner_s": statistics.mean(m["time/learner_group_s"] for m in lines),
        "rollout_wait_s": statistics.mean(m["time/rollout_wait_s"] for m in lines),
        "weight_sync_s": statistics.mean(m["time/weight_sync_s"] for m in lines),
        "weight_publish_s": statistics.mean(m["time/weight_publish_s"] for m in lines),
        "actor_weight_load_s": sum(m["ray/weight_load_s"] for m in lines) / max(sum(m["ray/weight_loads"]
                                                                                    for m in lines), 1),
    }


def server_cell(backend: str, urls: list[str], model: Path, steps: int, root: Path, round_: int) -> dict[str, float]:
    """2 rollout workers (local processes or Ray actors) generating on ``urls``; the learner in the driver."""
    lines = timed_lines(root / f"{backend}_server_{round_}", [
        f"async.backend={backend}", "async.num_workers=2", f"model.path={model}", "rollout.engine=server",
        f"rollout.server.urls=[{','.join(urls)}]"], steps, root)
    step_s = [m["time/step_s"] for m in lines]
    return {"backend": backend, "servers": len(urls), "round": round_, "steps_timed": len(lines),
            "steps_per_s": len(step_s) / sum(step_s),
            "rollout_wait_s": statistics.mean(m["time/rollout_wait_s"] for m in lines),
            "weight_publish_s": statistics.mean(m["time/weight_publish_s"] for m in lines)}


def server_cells(count: int, rounds: int, steps: int, root: Path) -> list[dict[str, float]]:
    """Local and Ray backends alternated on the same ``count`` `vcpo serve` processes of the default model."""
    from serve_throughput import start_servers

    from vcpo.config import TaskConfig
    from vcpo.models.default import build_default_model
    from vcpo.tasks import make_task

    model = build_default_model(make_task(TaskConfig()), 0, root / "model")
    procs = start_servers(model, count)
    cells = []
    try:
        for r in range(rounds):
            for backend in ("local", "ray"):
                cells.append(server_cell(backend, [u for u, _ in procs], model, steps, root, r))
                print(json.dumps(cells[-1]), flush=True)
    finally:
        for _, proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    return cells


def sync_cell(mode: str, steps: int, root: Path, round_: int) -> dict[str, float]:
    """2 rollout actors and 1 learner actor, weights to the actors by ``ray.weight_sync=mode``."""
    lines = timed_lines(root / f"{mode}_{round_}", ["async.backend=ray", "async.num_workers=2",
                                                    f"ray.weight_sync={mode}"], steps, root)
    step_s = [m["time/step_s"] for m in lines]
    loads = sum(m["ray/weight_loads"] for m in lines)
    return {"weight_sync": mode, "round": round_, "steps_timed": len(lines), "steps_per_s": len(step_s) / sum(step_s),
            "weight_sync_s": statistics.mean(m["time/weight_sync_s"] for m in lines),
            "weight_put_s": statistics.mean(m["time/weight_put_s"] for m in lines),
            "weight_broadcast_s": statistics.mean(m.get("time/weight_broadcast_s", 0.0) for m in lines),
            "weight_publish_s": statistics.mean(m["time/weight_publish_s"] for m in lines),
            "actor_store_fetches_per_step": loads / len(lines),
            "actor_store_fetch_s": sum(m["ray/weight_load_s"] for m in lines) / max(loads, 1),
            "broadcast_fallbacks": lines[-1].get("ray/broadcast_fallbacks", 0.0)}


def broadcast_throughput(megabytes: int, receivers: int = 2, repeats: int = 3) -> dict[str, float]:
    """Seconds to get a bfloat16 state dict of ``megabytes`` from one actor to ``receivers`` actors: a gloo broadcast
    in the weight-broadcast group (flat buffer), against ``ray.put`` by the sender and ``ray.get`` by each receiver."""
    import ray

    from vcpo.orchestration.ray.broadcast import BroadcastMember, broadcast_layout, free_endpoint

    n = megabytes * 2**20 // 2 // 64
    layout = broadcast_layout({f"layer{i}": torch.empty(n, dtype=torch.bfloat16) for i in range(64)})

    @ray.remote(num_cpus=0)
    class Member:
        def join(self, address: str, port: int, rank: int) -> None:
            self.member = BroadcastMember(address, port, rank, receivers + 1, 300, "gloo", layout)
            self.state = {key: torch.ones(shape, dtype=dtype) for key, shape, dtype in layout} if rank == 0 else None

        def broadcast(self) -> float:
            t0 = time.perf_counter()
            if self.state is not None:
                self.member.send(self.state)
            else:
                self.member.receive()
            return time.perf_counter() - t0

        def put(self) -> list:
            return [ray.put(self.state)]

        def fetch(self, refs: list) -> float:
            t0 = time.perf_counter()
            ray.get(refs[0])
            return time.perf_counter() - t0

    members = [Member.remote() for _ in range(receivers + 1)]
    address, port = ray.get(ray.remote(num_cpus=0)(free_endpoint).remote())
    ray.get([m.join.remote(address, port, rank) for rank, m in enumerate(members)])
    broadcast_s, store_s = [], []
    for _ in range(repeats):
        broadcast_s.append(max(ray.get([m.broadcast.remote() for m in members])))
        t0 = time.perf_counter()
        refs = ray.get(members[0].put.remote())
        ray.get([m.fetch.remote(refs) for m in members[1:]])
        store_s.append(time.perf_counter() - t0)
        del refs
    for m in members:
        ray.kill(m)
    return {"megabytes": megabytes, "receivers": receivers, "broadcast_s": min(broadcast_s),
            "object_store_s": min(store_s)}


def object_store_throughput(megabytes: int, repeats: int = 3) -> dict[str, float]:
    """GB/s of ``ray.put`` of a bfloat16 state dict of ``megabytes`` and of an actor's ``ray.get`` of it."""
    import ray

    @ray.remote(num_cpus=0)
    def fetch(refs: list) -> float:
        t0 = time.perf_counter()
        state = ray.get(refs[0])
        sum(v.numel() for v in state.values())
        return time.perf_counter() - t0

    n = megabytes * 2**20 // 2 // 64
    state = {f"layer{i}": torch.zeros(n, dtype=torch.bfloat16) for i in range(64)}
    put_s, get_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ref = ray.put(state)
        put_s.append(time.perf_counter() - t0)
        get_s.append(ray.get(fetch.remote([ref])))
        del ref
    gb = megabytes / 1024
    return {"megabytes": megabytes, "put_GBps": gb / min(put_s), "get_GBps": gb / min(get_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--store-mb", type=int, default=512)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--servers", type=int, default=0, help="N > 0: local vs Ray on N vcpo serve processes")
    parser.add_argument("--rounds", type=int, default=2, help="with --servers or --weight-sync: alternations")
    parser.add_argument("--weight-sync", action="store_true", help="ray.weight_sync object_store against broadcast")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vcpo.config import load_config
    from vcpo.orchestration.ray.session import RaySession

    root = Path(tempfile.mkdtemp(prefix="ray_scaling_"))
    results = {"load_avg_start": os.getloadavg()[0], "cpus": os.cpu_count(), "cells": []}
    try:
        with RaySession(load_config(None, ["async.backend=ray", "ray.num_cpus=4"])):
            if args.servers:
                results["cells"] = server_cells(args.servers, args.rounds, args.steps, root)
            elif args.weight_sync:
                for r in range(args.rounds):
                    for mode in ("object_store", "broadcast"):
                        results["cells"].append(sync_cell(mode, args.steps, root, r))
                        print(json.dumps(results["cells"][-1]), flush=True)
                results["throughput"] = broadcast_throughput(args.store_mb)
                print(json.dumps(results["throughput"]), flush=True)
            else:
                for workers, learners in CELLS:
                    results["cells"].append(cell(workers, learners, args.steps, root))
                    print(json.dumps(results["cells"][-1]), flush=True)
                results["object_store"] = object_store_throughput(args.store_mb)
                print(json.dumps(results["object_store"]), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(results, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = (f"results_servers{args.servers}.json" if args.servers
                else "results_weight_sync.json" if args.weight_sync else "results.json")
        (args.out / name).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
