"""Steps per second of the Ray backend with 1 and 2 rollout actors and 1 and 2 learner ranks, the weight-sync time
per step, and the object store's put/get throughput (what the CPU fallback of weight sync costs per byte).

Run by hand (results in benchmarks/RESULTS.md):
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/ray_scaling.py --steps 12 [--out benchmarks/ray_scaling]

Each cell is one `vcpo train` (in this process) on one shared local Ray instance; the first 2 steps (actor start,
the first rollouts) are left out of the rates. The model is the embedded default without a warm start
(sft.steps=0): rollout and learner costs do not depend on what the model has learned.
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


def cell(workers: int, learners: int, steps: int, root: Path) -> dict[str, float]:
    from vcpo.config import load_config
    from vcpo.train.trainer import train

    run = root / f"w{workers}_l{learners}"
    config = load_config("configs/quickstart.yaml", [
        f"run_dir={run}", f"sft.cache_dir={root / 'cache'}", "sft.steps=0", f"trainer.max_steps={steps}",
        "trainer.eval_every=0", "trainer.checkpoint_every=0", "task.eval_size=8", "logging.progress=false",
        "rollout.prompts_per_step=8", "rollout.group_size=4", "async.mode=async", "async.max_staleness=2",
        "async.inflight_updates=true", "async.backend=ray", f"async.num_workers={workers}",
        f"trainer.num_learners={learners}",
    ])
    train(config)
    lines = read_metrics(run / METRICS_FILE)[2:]
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
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vcpo.config import load_config
    from vcpo.orchestration.ray.session import RaySession

    root = Path(tempfile.mkdtemp(prefix="ray_scaling_"))
    results = {"load_avg_start": os.getloadavg()[0], "cpus": os.cpu_count(), "cells": []}
    try:
        with RaySession(load_config(None, ["async.backend=ray", "ray.num_cpus=4"])):
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
        (args.out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
