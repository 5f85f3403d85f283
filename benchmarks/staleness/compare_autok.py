"""Adaptive staleness against fixed k (issue 26, item 5a): each ``ARM_auto`` cell of an exported sweep is paired by
warm start and seed with the fixed-k cells of ``ARM`` in the committed study2 cells; prints a markdown table of late
accuracy (mean of the last 3 held-out evaluations), collapses, the mean bound k and the mean lag of the trained
tokens, the mean ESS ratio, and the paired late-accuracy difference auto - fixed over the pairs present:

    python benchmarks/staleness/compare_autok.py benchmarks/staleness/study2_autok benchmarks/staleness/study2
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from vcpo.study.report import load_cells
from vcpo.study.stats import t_interval


def _mean(values: list[float]) -> str:
    return f"{statistics.fmean(values):.3f}" if values else "-"


def _row(label: str, cells: list[dict], paired: list[float] | None) -> str:
    late = [c["late_accuracy"] for c in cells if c["late_accuracy"] is not None]
    collapsed = sum(c["collapse_step"] is not None for c in cells)
    # A fixed-k lagged cell's bound is k and its lag min(step - 1, k) (batches 0..k come from version 0).
    bound = [c["mean_bound"] if c["mean_bound"] is not None else float(c["k"]) for c in cells]
    lag = [statistics.fmean(r.get("staleness/mean", min(r["step"] - 1, c["k"])) for r in c["records"])
           for c in cells]
    ess = [c["mean_ess_ratio"] for c in cells]
    diff = "-"
    if paired:
        iv = t_interval(paired)
        diff = f"{iv.mean:+.3f}" + (f" [{iv.low:+.3f}, {iv.high:+.3f}]" if iv.n > 1 else "")
    return (f"| {label} | {len(cells)} | {_mean(late)} | {collapsed} | {_mean(bound)} | {_mean(lag)} | "
            f"{_mean(ess)} | {diff} |")


def compare(auto_dir: Path, fixed_dir: Path, ks: list[int]) -> str:
    auto_cells, _ = load_cells(auto_dir)
    fixed_cells, _ = load_cells(fixed_dir)
    out = ["| arm | runs | late accuracy | collapsed | mean bound k | mean lag | mean ESS | auto - this k, paired "
           "(95% t interval) |", "|---|---|---|---|---|---|---|---|"]
    for arm in sorted({c["arm"] for c in auto_cells}):
        base = arm.removesuffix("_auto")
        auto = [c for c in auto_cells if c["arm"] == arm]
        runs = {(c["warm_start"], c["seed"]) for c in auto}
        by_run = {(c["warm_start"], c["seed"]): c["late_accuracy"] for c in auto}
        out.append(_row(f"{arm} (k in [4, {auto[0]['k']}])", auto, None))
        for k in ks:
            fixed = [c for c in fixed_cells
                     if c["arm"] == base and c["k"] == k and (c["warm_start"], c["seed"]) in runs]
            paired = [by_run[(c["warm_start"], c["seed"])] - c["late_accuracy"] for c in fixed]
            out.append(_row(f"{base} k={k}", fixed, paired))
    return "\n".join(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("auto_dir", type=Path, help="An exported sweep of *_auto arms (its cells/ directory inside).")
    ap.add_argument("fixed_dir", type=Path, help="The study2 sweep with the fixed-k cells.")
    ap.add_argument("--ks", default="0,16,64,128", help="The fixed k to compare with.")
    args = ap.parse_args()
    print(compare(args.auto_dir, args.fixed_dir, [int(k) for k in args.ks.split(",")]))
