"""Peak memory of one learner step: the full [B, S, V] log-softmax path against the lean (chunked LM head) path,
with and without micro-batches and activation checkpointing, for a GRPO step and a fast-OPOB VCPO step.

Each configuration runs in its own forked process: two warm-up steps, then one measured step. On the CPU the
figure is the rise of the resident set's high-water mark during that step (``VmHWM`` after resetting it through
``/proc/self/clear_refs``), with glibc told to return every freed block of 128 KiB or more to the system at once
(fixed mmap and trim thresholds; by default it raises its mmap threshold up to 32 MiB and keeps blocks below it
for reuse, which would hide a step's activations in memory the warm-up steps left behind); on
CUDA it is ``torch.cuda.max_memory_allocated`` during the step minus what was allocated before it (the model,
its gradients' storage and the optimizer state are held before; the step's activations and temporaries are what
the figure shows, plus the gradients and AdamW state created on the first step, already there).

    python benchmarks/learner_memory.py                                   # CPU, the "medium" setup
    python benchmarks/learner_memory.py --device cuda --setups xl --micro-batch-tokens 8192
    python benchmarks/learner_memory.py --device cuda --dtype bfloat16 --setups qwen05b_1k --micro-batch-tokens 16384
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import time

import torch
from step_overhead import SETUPS, build_batch, build_model

from vcpo.config import load_config
from vcpo.train.learner import Learner
from vcpo.variance import logprobs

ARMS = {
    "grpo": ["objective.name=grpo", "advantage.estimator=grpo", "trainer.ess_lr.enabled=false"],
    "vcpo_fast": ["objective.name=vcpo", "advantage.estimator=opob", "advantage.grad_norm_method=fast"],
}


def _rss_high_water_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _release_freed_memory() -> None:
    """glibc: blocks of 128 KiB or more are mmap'ed and unmapped when freed; the heap is trimmed above 128 KiB."""
    mallopt = ctypes.CDLL("libc.so.6").mallopt
    mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD (a fixed value also stops its dynamic growth)
    mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD


def _one(setup: str, arm: str, variant: dict, device: str, dtype: str, threads: int) -> tuple[float, float]:
    """(peak MiB above the level before the step, step seconds) of one configuration, in this process."""
    if not device.startswith("cuda"):
        _release_freed_memory()
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    if not variant["lean"]:
        logprobs.LEAN_MIN_LOGITS = 1 << 62  # the full [B, S, V] path at any size
    s = SETUPS[setup]
    model = build_model(s, device, getattr(torch, dtype))
    batch = build_batch(s, model, device)
    overrides = [*ARMS[arm], f"trainer.micro_batch_tokens={variant['micro'] or 'null'}",
                 f"trainer.gradient_checkpointing={str(variant['ckpt']).lower()}"]
    learner = Learner(model, load_config(None, overrides))
    for _ in range(2):
        learner.step(batch)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current resident set
        base = _current_rss_mib()
    t0 = time.perf_counter()
    learner.step(batch)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20, time.perf_counter() - t0
    return _rss_high_water_mib() - base, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", default="medium", help=f"comma-separated, from {', '.join(SETUPS)}")
    ap.add_argument("--arms", default="grpo,vcpo_fast", help=f"comma-separated, from {', '.join(ARMS)}")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--micro-batch-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    variants = {
        "full log-softmax": {"lean": False, "micro": None, "ckpt": False},
        "lean": {"lean": True, "micro": None, "ckpt": False},
        f"lean + micro {args.micro_batch_tokens}": {"lean": True, "micro": args.micro_batch_tokens, "ckpt": False},
        "lean + micro + ckpt": {"lean": True, "micro": args.micro_batch_tokens, "ckpt": True},
    }
    print(f"device={args.device} dtype={args.dtype} threads={args.threads} torch={torch.__version__}")
    ctx = multiprocessing.get_context("spawn" if args.device.startswith("cuda") else "fork")
    for setup in args.setups.split(","):
        s = SETUPS[setup]
        print(f"\nsetup {setup}: B={s.prompts * s.group}, prompt {s.prompt_len}, response <= {s.response_len}, "
              f"vocab {s.vocab}, hidden {s.hidden}, {s.layers} layers")
        print(f"{'arm':<11}{'variant':<26}{'peak above start (MiB)':>24}{'step (s)':>10}")
        for arm in args.arms.split(","):
            for name, variant in variants.items():
                with ctx.Pool(1) as pool:
                    peak, seconds = pool.apply(_one, (setup, arm, variant, args.device, args.dtype, args.threads))
                print(f"{arm:<11}{name:<26}{peak:>24.0f}{seconds:>10.2f}")


if __name__ == "__main__":
    main()
