"""The staleness bound k (``staleness/bound``), the lag of the trained tokens (``staleness/max``) and the ESS ratio
over runs with ``async.max_staleness: auto``, one column per run, read from each run's metrics.jsonl:

    python benchmarks/staleness/plot_autok.py benchmarks/staleness/study2_autok/cells/{grpo,m2po,vcpo}_auto_k128_w0_s0 \
        --target 0.4 --out benchmarks/staleness/study2_autok/k_and_ess.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from vcpo.metrics import read_metrics


def moving_mean(values: list[float], n: int) -> list[float]:
    """The mean of each value and the up to n - 1 before it."""
    return [sum(values[max(0, i - n + 1):i + 1]) / (i + 1 - max(0, i - n + 1)) for i in range(len(values))]


def plot(run_dirs: list[Path], target: float | None, window: int, out: Path) -> None:
    fig, axes = plt.subplots(2, len(run_dirs), figsize=(4.2 * len(run_dirs), 5.6), sharex=True, squeeze=False)
    for col, run_dir in enumerate(run_dirs):
        records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "staleness/bound" in r]
        steps = [r["step"] for r in records]
        top, bottom = axes[0][col], axes[1][col]
        top.step(steps, [r["staleness/bound"] for r in records], where="post", color="C3", lw=2, label="bound k")
        top.plot(steps, [r["staleness/max"] for r in records], color="C0", lw=1, label="lag of the batch (max)")
        top.set_title(run_dir.name, fontsize=9)
        top.set_ylabel("optimizer steps")
        ess = [r["ess/ratio"] for r in records]
        bottom.plot(steps, ess, color="0.7", lw=0.6, label="ESS ratio")
        bottom.plot(steps, moving_mean(ess, window), color="C2", lw=1.6, label=f"{window}-step mean")
        if target is not None:
            bottom.axhline(target, color="k", ls=":", lw=1, label=f"target {target:g}")
        bottom.set_ylim(0, 1.05)
        bottom.set_ylabel("ESS ratio")
        bottom.set_xlabel("step")
        if col == 0:
            top.legend(fontsize=7, loc="upper left")
            bottom.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", type=Path, nargs="+")
    ap.add_argument("--target", type=float, default=None, help="The runs' async.auto.ess_target, drawn as a line.")
    ap.add_argument("--window", type=int, default=10, help="Steps of the ESS moving mean (async.auto.window).")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    plot(args.run_dirs, args.target, args.window, args.out)
