"""Full fine-tuning against LoRA, side by side: bytes published per policy version, weight-sync time per step, the
learner's step time (wall and CPU: on a shared machine the process's CPU time is the steadier figure) and memory, on
the embedded default model and the 14.2M one.

Each (model, arm) runs in its own forked process. The learner step is the quickstart's (VCPO, OPOB with fast ghost
norms, ESS-scaled lr) on a batch built as benchmarks/step_overhead.py builds it: two warm-up steps, then the median of
``--repeats`` timed steps. "peak" is the rise of the resident set's high-water mark during one more step
(benchmarks/learner_memory.py's method: activations and temporaries); "resident" is the resident set before that step
(the interpreter, torch, the model, its gradients and the optimizer state). Weight sync is what each version costs the
learner's process and one receiving engine: "shm+load" = copying the published tensors into the async workers'
shared copy (AsyncSource.publish) plus a worker engine's ``load_weights`` of them; "dir" = writing the version
directory ``vcpo serve`` reads (``write_weights_dir``). Medians over ``--repeats`` publications.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/lora_costs.py --rank 8
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time

import torch
from learner_memory import _current_rss_mib, _release_freed_memory, _rss_high_water_mib
from step_overhead import SETUPS, Setup, build_batch, build_model

from vcpo.config import load_config
from vcpo.models.lora import apply_lora, sync_state_dict
from vcpo.rollout.engine import HFRolloutEngine
from vcpo.rollout.weights import write_weights_dir
from vcpo.train.learner import Learner

MODELS = {
    "default": SETUPS["default"],  # 0.44M parameters, the quickstart batch: 16 prompts x 8, responses <= 6 tokens
    # benchmarks/serve_throughput.py's "large": 6 layers, d=384, the 103-token character vocabulary: 14.2M parameters
    # (8 prompts x 8, responses <= 32 tokens after a 16-token prompt)
    "14.2M": Setup("14.2M", 384, 6, 6, 1536, 103, 8, 8, 16, 32),
}
OVERRIDES = ["objective.name=vcpo", "advantage.estimator=opob", "advantage.grad_norm_method=fast", "trainer.lr=1e-4"]


def _model(s: Setup, rank: int) -> torch.nn.Module:
    model = build_model(s, "cpu")
    return model if rank == 0 else apply_lora(model, rank=rank, alpha=2.0 * rank)


def _one(name: str, rank: int, repeats: int) -> dict[str, float]:
    _release_freed_memory()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    s = MODELS[name]
    model = _model(s, rank)
    batch = build_batch(s, model, "cpu")
    learner = Learner(model, load_config(None, OVERRIDES))
    for _ in range(2):
        learner.step(batch)
    times, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        learner.step(batch)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark back to the current resident set
    base = _current_rss_mib()
    learner.step(batch)
    peak = _rss_high_water_mib() - base

    published = sync_state_dict(model)
    shared = {k: v.detach().clone().share_memory_() for k, v in published.items()}
    engine = HFRolloutEngine(_model(s, rank), eos_id=1, pad_id=0)
    shm, disk = [], []
    with tempfile.TemporaryDirectory() as root:
        for version in range(1, repeats + 1):
            t0 = time.perf_counter()
            with torch.no_grad():
                for k, v in sync_state_dict(model).items():
                    shared[k].copy_(v)
                engine.load_weights({k: v.clone() for k, v in shared.items()}, version)  # the worker's poll + load
            shm.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            write_weights_dir(root, sync_state_dict(model), version)
            disk.append(time.perf_counter() - t0)
    return {
        "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
        "trainable_M": sum(p.numel() for p in learner.params) / 1e6,
        "bytes": float(sum(v.numel() * v.element_size() for v in published.values())),
        "shm_ms": 1e3 * statistics.median(shm), "disk_ms": 1e3 * statistics.median(disk),
        "step_s": statistics.median(times), "step_cpu_s": statistics.median(cpu), "peak_mib": peak,
        "resident_mib": base,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="default,14.2M", help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--rank", type=int, default=8, help="the LoRA arm's rank (alpha = 2 x rank, all linear layers)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"torch={torch.__version__} threads=1 repeats={args.repeats} float32, CPU", flush=True)
    print(f"{'model':<9}{'arm':<10}{'params M':>9}{'trained M':>10}{'bytes/version':>15}{'shm+load ms':>12}"
          f"{'dir ms':>8}{'step s':>8}{'cpu s':>7}{'peak MiB':>9}{'resident MiB':>13}")
    ctx = multiprocessing.get_context("fork")
    for name in args.models.split(","):
        for rank in (0, args.rank):
            with ctx.Pool(1) as pool:
                r = pool.apply(_one, (name, rank, args.repeats))
            arm = "full FT" if rank == 0 else f"LoRA r={rank}"
            print(f"{name:<9}{arm:<10}{r['params_M']:>9.2f}{r['trainable_M']:>10.3f}{r['bytes']:>15,.0f}"
                  f"{r['shm_ms']:>12.2f}{r['disk_ms']:>8.2f}{r['step_s']:>8.3f}{r['step_cpu_s']:>7.3f}{r['peak_mib']:>9.0f}"
                  f"{r['resident_mib']:>13.0f}",
                  flush=True)


if __name__ == "__main__":
    main()
