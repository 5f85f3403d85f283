"""Copy a finished `vcpo sweep` directory into the repository without its checkpoints: per cell the resolved
config, summary, provenance (cell.json) and the metrics the report, the detector and `vcpo rerun` read, floats
rounded to :data:`SIGNIFICANT_DIGITS`, so that `vcpo report OUT_DIR` regenerates the report from those files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from vcpo.metrics import read_metrics
from vcpo.study.provenance import CELL_FILE

KEPT = ("step", "eval/accuracy", "eval/accuracy_initial", "reward/mean", "ess/ratio", "grad_norm", "time/learner_s",
        "time/step_s", "reward/zero_var_group_frac", "entropy/mean", "lr", "skipped_step", "staleness/bound",
        "staleness/mean", "staleness/max", "staleness/dropped_over_bound")
"""The per-step keys kept: what the report and the early-warning detectors read, the step's costs, and the lag of
the trained tokens with the bound in force (``staleness/bound``: adaptive cells only)."""
SIGNIFICANT_DIGITS = 5
"""The report prints three decimals; five significant digits still tell two runs apart at the first step
where any kept metric differs by more than 1e-5 relative (see `vcpo rerun`)."""
CELL_FILES = ("config.yaml", "summary.json", CELL_FILE)


def rounded(value: Any) -> Any:
    """A float to :data:`SIGNIFICANT_DIGITS` significant digits (idempotent); anything else unchanged."""
    return float(f"{value:.{SIGNIFICANT_DIGITS}g}") if isinstance(value, float) else value


def export_sweep(sweep_dir: Path, out_dir: Path) -> int:
    """Export every finished cell of ``sweep_dir`` (and its sweep.json, results.jsonl) to ``out_dir``; returns
    the number of cells. Raises FileNotFoundError naming the directory when no cell finished."""
    sweep_dir, out_dir = Path(sweep_dir), Path(out_dir)
    cells_dir = sweep_dir / "cells"
    cells = sorted(d for d in cells_dir.iterdir() if (d / "summary.json").is_file()) if cells_dir.is_dir() else []
    if not cells:
        raise FileNotFoundError(f"no finished cell (summary.json) under {cells_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("sweep.json", "results.jsonl"):
        if (sweep_dir / name).is_file():
            shutil.copy2(sweep_dir / name, out_dir / name)
    for cell in cells:
        dest = out_dir / "cells" / cell.name
        dest.mkdir(parents=True, exist_ok=True)
        for name in CELL_FILES:
            if (cell / name).is_file():
                shutil.copy2(cell / name, dest / name)
        lines = ({k: rounded(r[k]) for k in KEPT if k in r} for r in read_metrics(cell / "metrics.jsonl"))
        (dest / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return len(cells)
