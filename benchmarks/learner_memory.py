"""Peak memory of one learner step: the full [B, S, V] log-softmax path against the lean (chunked LM head) path,
with and without micro-batches and activation checkpointing, for a GRPO step, a fast-OPOB VCPO step and a VCPO
step with the logit proxy (grad_only). A configuration that runs out of memory is reported as such, with what it
tried to allocate, and the benchmark goes on.

On the CPU each configuration runs in its own forked process; on CUDA one after another in this process (the
allocator's statistics are exact per step, and the model is built once): two warm-up steps, then one measured
step. On the CPU the
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
import copy
import ctypes
import gc
import multiprocessing
import time

import torch
from step_overhead import ARMS as STEP_ARMS
from step_overhead import SETUPS, build_batch, build_model

from vcpo.config import load_config
from vcpo.train.learner import Learner
from vcpo.variance import logprobs

DEFAULT_LEAN_MIN = logprobs.LEAN_MIN_LOGITS

ARMS = {arm: STEP_ARMS[arm] for arm in ("grpo", "vcpo_fast", "vcpo_proxy_grad_only")}


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


def _one(setup: str, arm: str, variant: dict, device: str, dtype: str, threads: int,
         built: tuple | None = None) -> tuple[float, float]:
    """(peak MiB above the level before the step, step seconds) of one configuration, in this process; ``built``:
    the (model, batch) to copy instead of building them."""
    if not device.startswith("cuda"):
        _release_freed_memory()
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    logprobs.LEAN_MIN_LOGITS = DEFAULT_LEAN_MIN if variant["lean"] else 1 << 62  # full: the [B, S, V] path
    s = SETUPS[setup]
    if built is None:
        model = build_model(s, device, getattr(torch, dtype))
        batch = build_batch(s, model, device)
    else:
        model, batch = copy.deepcopy(built[0]), built[1]
    overrides = [*STEP_ARMS[arm], f"trainer.micro_batch_tokens={variant['micro'] or 'null'}",
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


def _out_of_memory(e: BaseException) -> str:
    """The allocator's own words on what it tried to allocate (first sentence)."""
    return str(e).split(". ")[0].strip()


def _run_cuda(setup: str, arms: list[str], variants: dict, dtype: str) -> None:
    s = SETUPS[setup]
    model = build_model(s, "cuda", getattr(torch, dtype))
    batch = build_batch(s, model, "cuda")
    for arm in arms:
        for name, variant in variants.items():
            try:
                peak, seconds = _one(setup, arm, variant, "cuda", dtype, 1, (model, batch))
                print(f"{arm:<22}{name:<26}{peak:>24.0f}{seconds:>10.2f}", flush=True)
            except torch.OutOfMemoryError as e:
                print(f"{arm:<22}{name:<26}{'out of memory':>24}{'-':>10}  ({_out_of_memory(e)})", flush=True)
            gc.collect()
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", default="medium", help=f"comma-separated, from {', '.join(SETUPS)}")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(STEP_ARMS)}")
    ap.add_argument("--variants", default=None, help="comma-separated variant names to run (default: all)")
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
    if args.variants:
        variants = {name: v for i, (name, v) in enumerate(variants.items())
                    if name in args.variants.split(",") or str(i) in args.variants.split(",")}
    gpu = f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""
    print(f"device={args.device}{gpu} dtype={args.dtype} threads={args.threads} torch={torch.__version__}")
    arms = args.arms.split(",")
    for setup in args.setups.split(","):
        s = SETUPS[setup]
        print(f"\nsetup {setup}: B={s.prompts * s.group}, prompt {s.prompt_len}, response <= {s.response_len}, "
              f"vocab {s.vocab}, hidden {s.hidden}, {s.layers} layers")
        print(f"{'arm':<22}{'variant':<26}{'peak above start (MiB)':>24}{'step (s)':>10}")
        if args.device.startswith("cuda"):
            _run_cuda(setup, arms, variants, args.dtype)
            continue
        for arm in arms:
            for name, variant in variants.items():
                with multiprocessing.get_context("fork").Pool(1) as pool:
                    try:
                        peak, seconds = pool.apply(_one, (setup, arm, variant, args.device, args.dtype, args.threads))
                    except (MemoryError, RuntimeError) as e:  # the CPU allocator's "can't allocate memory"
                        if "allocate" not in str(e) and not isinstance(e, MemoryError):
                            raise
                        print(f"{arm:<22}{name:<26}{'out of memory':>24}{'-':>10}  ({_out_of_memory(e)})")
                        continue
                print(f"{arm:<22}{name:<26}{peak:>24.0f}{seconds:>10.2f}")


if __name__ == "__main__":
    main()
