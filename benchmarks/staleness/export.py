"""Copy a finished `vcpo sweep` directory into the repository without its checkpoints.

Keeps sweep.json, results.jsonl and, per cell, config.yaml, summary.json and the metrics that
`vcpo report` reads (step, held-out accuracy, reward, ESS ratio, grad norm, learner step time;
floats to five significant digits), so that `vcpo report OUT_DIR` regenerates the report from the committed files:

    python benchmarks/staleness/export.py runs/sweep_full benchmarks/staleness/full
    vcpo report benchmarks/staleness/full
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from vcpo.metrics import read_metrics

KEPT = ("step", "eval/accuracy", "eval/accuracy_initial", "reward/mean", "ess/ratio", "grad_norm", "time/learner_s")


def export(sweep_dir: Path, out_dir: Path) -> int:
    cells = sorted(d for d in (sweep_dir / "cells").iterdir() if (d / "summary.json").is_file())
    if not cells:
        raise SystemExit(f"no finished cell (summary.json) under {sweep_dir / 'cells'}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("sweep.json", "results.jsonl"):
        if (sweep_dir / name).is_file():
            shutil.copy2(sweep_dir / name, out_dir / name)
    for cell in cells:
        dest = out_dir / "cells" / cell.name
        dest.mkdir(parents=True, exist_ok=True)
        for name in ("config.yaml", "summary.json"):
            shutil.copy2(cell / name, dest / name)
        # Five significant digits: the report prints three decimals.
        lines = ({k: float(f"{r[k]:.5g}") if isinstance(r[k], float) else r[k] for k in KEPT if k in r}
                 for r in read_metrics(cell / "metrics.jsonl"))
        (dest / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return len(cells)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    args = ap.parse_args()
    print(f"exported {export(args.sweep_dir, args.out_dir)} cells to {args.out_dir}")
