"""Copy a finished `vcpo sweep` directory into the repository without its checkpoints (vcpo.study.export):

    python benchmarks/staleness/export.py runs/study2 benchmarks/staleness/study2
    vcpo report benchmarks/staleness/study2
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vcpo.study.export import export_sweep

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    args = ap.parse_args()
    try:
        print(f"exported {export_sweep(args.sweep_dir, args.out_dir)} cells to {args.out_dir}")
    except FileNotFoundError as exc:
        raise SystemExit(f"error: {exc}") from None
