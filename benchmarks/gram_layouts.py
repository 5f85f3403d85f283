"""How fast a batch of per-row token Grams ``x_b x_b^T`` ([B, n, d] -> [B, n, n]) runs, by how it is asked for,
against a plain matrix product of the same FLOPs: the fast OPOB norms spend their matrix time in such Grams, and
a GPU's batched-GEMM heuristics do not always pick its best kernel for them.

Layouts: ``bmm(x, x^T)`` (a transposed view of the same tensor, as ghost_layers asks), the same with a float32
result from the kernel (``out_dtype``, where the build has it), ``bmm(x, copy of x^T)`` (the copy included), the
product of the d-major copy ``x^T`` with itself (``(x^T)^T x^T``, the copy included), the same in float16, and the
product in float32 (TF32 allowed); the reference is ``mm`` of [B n, d] by [d, n] (the same FLOPs). Median of
``--repeats`` after a warm-up, in TFLOP/s.

    python benchmarks/gram_layouts.py --device cuda
    python benchmarks/gram_layouts.py --device cpu --shapes 4x128x256
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], torch.Tensor], device: str, repeats: int) -> float:
    """Median seconds of ``fn`` (synchronised on CUDA) after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="16x512x896,16x512x4864,16x384x128",
                    help="comma-separated BxNxD: rows, tokens, width")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device {args.device} ({name}), torch {torch.__version__}; TFLOP/s (median of {args.repeats})")
    print(f"{'B x n x d':<16}{'bmm(x, x^T)':>13}{'out f32':>10}{'x^T copied':>12}{'d-major':>10}{'float16':>10}"
          f"{'float32':>10}{'mm, same':>10}")
    for shape in args.shapes.split(","):
        B, n, d = map(int, shape.split("x"))
        rates = {}
        for k, fn in layouts(B, n, d, args.device).items():
            try:
                rates[k] = 2 * B * n * n * d / timed(fn, args.device, args.repeats) / 1e12
            except (RuntimeError, TypeError, NotImplementedError):  # out_dtype: not on every build or device
                rates[k] = float("nan")
        print(f"{shape:<16}{rates['view']:>13.1f}{rates['out_f32']:>10.1f}{rates['copied']:>12.1f}"
              f"{rates['d_major']:>10.1f}{rates['float16']:>10.1f}{rates['float32']:>10.1f}{rates['mm']:>10.1f}")


def layouts(B: int, n: int, d: int, device: str) -> dict[str, Callable[[], torch.Tensor]]:
    """The ways of asking for the Grams of random [B, n, d] bfloat16 rows, and the plain product of their FLOPs."""
    x = torch.randn(B, n, d, device=device, dtype=torch.bfloat16)
    x16, x32 = x.half(), x.float()
    flat, right = x.reshape(B * n, d), torch.randn(d, n, device=device, dtype=torch.bfloat16)
    return {
        "view": lambda: torch.bmm(x, x.transpose(1, 2)),
        "out_f32": lambda: torch.bmm(x, x.transpose(1, 2), out_dtype=torch.float32),
        "d_major": lambda: (lambda xt: torch.bmm(xt.transpose(1, 2), xt))(x.transpose(1, 2).contiguous()),
        "copied": lambda: torch.bmm(x, x.transpose(1, 2).contiguous()),
        "float16": lambda: torch.bmm(x16, x16.transpose(1, 2)),
        "float32": lambda: torch.bmm(x32, x32.transpose(1, 2)),
        "mm": lambda: flat @ right,
    }

if __name__ == "__main__":
    main()
