"""Why the fast OPOB step costs what it does: the per-row norms alone, against a GRPO step, on one batch.

The fast VCPO step is a GRPO step's forward and backward plus the per-row squared gradient norms
(the backward's weight gradients move into the assembly, which runs the same matrix products). So
if everything else cost exactly what GRPO's does, ``vcpo_fast/grpo`` would be ``1 + norms / GRPO
step``. This script measures, in one run and on the batch of ``step_overhead.py``:

- the median GRPO learner step;
- the median pass computing every row's norm from one capture (what ``PerRowGradCapture.sq_norms``
  runs);
- the throughput of the products behind them: the weight-gradient ``mm`` a backward runs, and the
  per-row token-Gram ``bmm`` the norms run, on data in cache (one tensor reused) and out of it
  (distinct tensors, as in the step).

    python benchmarks/gram_kernels.py                  # the default setup, 1 thread
    python benchmarks/gram_kernels.py --setup large
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch
from step_overhead import ARMS, SETUPS, build_batch, build_model

from vcpo.config import load_config
from vcpo.runtime import configure_cpu
from vcpo.train.learner import Learner
from vcpo.variance.ghost_layers import total_sq_norms
from vcpo.variance.ghost_norms import per_row_grad_capture


def median_s(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_rows(rows: int, tokens: int, widths: list[int], repeats: int) -> list[tuple[str, float, float]]:
    """(name, ms, GFLOP/s) of the weight-gradient mm and the per-row Gram bmm at each width."""
    out = []
    n_cold = 48  # distinct tensors: more than the caches hold at these sizes
    for d in widths:
        g = torch.randn(rows * tokens, 128)
        x = torch.randn(rows * tokens, d)
        ms = 1e3 * median_s(lambda g=g, x=x: g.T @ x, repeats)
        out.append((f"weight-grad mm [128 x {rows * tokens}] @ [{rows * tokens} x {d}]", ms,
                    2 * rows * tokens * 128 * d / ms / 1e6))
        xs = [torch.randn(rows, tokens, d) for _ in range(n_cold)]
        flops = 2 * rows * tokens * tokens * d
        hot = 1e3 * median_s(lambda x=xs[0]: torch.bmm(x, x.mT), repeats)
        out.append((f"per-row Gram bmm {rows} x [{tokens} x {d}], in cache", hot, flops / hot / 1e6))
        cycle = itertools.cycle(xs)
        cold = 1e3 * median_s(lambda c=cycle: (x := next(c), torch.bmm(x, x.mT)), repeats)
        out.append((f"per-row Gram bmm {rows} x [{tokens} x {d}], out of cache", cold, flops / cold / 1e6))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", default="default", choices=list(SETUPS))
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    configure_cpu(args.threads)
    s = SETUPS[args.setup]
    model = build_model(s, "cpu")
    batch = build_batch(s, model, "cpu")
    grpo = Learner(model, load_config(None, ARMS["grpo"]))
    B, T = batch.input_ids_BS.shape

    def norms() -> float:
        _, capture = per_row_grad_capture(model, batch.input_ids_BS, batch.response_mask_BS,
                                          batch.attention_mask_BS)
        # What capture.sq_norms() runs (it has already run and kept its result); the capture is not counted.
        t0 = time.perf_counter()
        total_sq_norms(capture.terms, B, batch.input_ids_BS.device)
        return time.perf_counter() - t0

    # Alternate so that drift hits both alike; the first two rounds are warm-up.
    step_times: list[float] = []
    norm_times: list[float] = []
    for _ in range(args.repeats + 2):
        t0 = time.perf_counter()
        grpo.step(batch)
        step_times.append(time.perf_counter() - t0)
        norm_times.append(norms())
    step, norm = statistics.median(step_times[2:]), statistics.median(norm_times[2:])
    print(f"setup {args.setup}: B={B}, T={T}, threads={args.threads}, torch={torch.__version__}, "
          f"repeats={args.repeats}")
    print(f"GRPO learner step (median)          {1e3 * step:9.2f} ms")
    print(f"fast per-row norms, all rows        {1e3 * norm:9.2f} ms")
    widths = sorted({s.hidden, s.intermediate})
    print(f"\n{'product':<58}{'ms':>9}{'GFLOP/s':>10}")
    for name, ms, gflops in kernel_rows(B, T, widths, args.repeats * 4):
        print(f"{name:<58}{ms:>9.3f}{gflops:>10.1f}")
    print(f"\nnorms / GRPO step (the fast step's excess if all else matched GRPO's): {norm / step:.3f}")


if __name__ == "__main__":
    main()
