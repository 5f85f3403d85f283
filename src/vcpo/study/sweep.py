"""`vcpo sweep`: a grid of (arm x staleness k x seed) runs in deterministic-lag mode, each cell one
`vcpo train` subprocess, a bounded number at a time, resumable (a cell with summary.json is skipped).

Grid sizes, measured on the 2-core development machine (one torch thread per cell, two cells at a time):
a step costs about 0.15 s (grpo) to 0.25-0.4 s (vcpo with OPOB, including evaluations); lagged mode
generates k+1 batches before the first step (0.05-0.1 s each, so about 13 s at k=128); start-up and the
initial evaluation add about 10 s per cell.
- FULL: 9 arms x 5 k x 2 seeds = 90 cells; 2 workers -> 45 cell slots; 2 hours = 7200 s -> 160 s per slot.
  At 300 steps: 300 x 0.4 s = 120 s + 10 s start + up to 13 s prefill = 143 s worst case (vcpo, k=128),
  about 60-80 s for the clipped baselines, so about 45 x 110 s = 5000 s (1.4 h) expected, < 2 h worst case.
- QUICK: 5 arms x 3 k x 1 seed = 15 cells; 2 workers -> 8 slots; 10 min = 600 s -> 75 s per slot.
  At 60 steps: 60 x 0.4 s = 24 s + 10 s start + 4 s prefill = 38 s per slot, about 5 minutes in all.
An interrupted cell is rerun from its start (cells are short; its partial run directory is overwritten).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

GRPO_ADV = "advantage.estimator=grpo"
NO_ESS_LR = "trainer.ess_lr.enabled=false"
ESS_LR = "trainer.ess_lr.enabled=true"

ARMS: dict[str, tuple[str, ...]] = {
    "grpo": ("objective.name=grpo", GRPO_ADV, NO_ESS_LR),
    "tis_seq": ("objective.name=tis", "objective.kwargs.level=sequence", "objective.kwargs.cap=8", GRPO_ADV, NO_ESS_LR),
    "icepop": ("objective.name=icepop", GRPO_ADV, NO_ESS_LR),
    "m2po": ("objective.name=m2po", GRPO_ADV, NO_ESS_LR),
    "vespo": ("objective.name=vespo", GRPO_ADV, NO_ESS_LR),
    "gspo": ("objective.name=gspo", GRPO_ADV, NO_ESS_LR),
    "vcpo": ("objective.name=vcpo", "advantage.estimator=opob", "advantage.grad_norm_method=fast", ESS_LR),
    "vcpo_ess_only": ("objective.name=vcpo", GRPO_ADV, ESS_LR),
    "vcpo_opob_only": ("objective.name=vcpo", "advantage.estimator=opob", "advantage.grad_norm_method=fast", NO_ESS_LR),
}
"""Each arm: the dotted overrides (as `vcpo train` takes them) that turn the base config into that method."""

# The study's lr: probes at 3e-4 (nothing collapses in 200 steps), 5e-4 (k=0 barely learns, k=64 grpo collapses)
# and 7e-4 / 1e-3 (even k=0 degrades) put it at 4e-4; see benchmarks/staleness/.
FULL_GRID = {"arms": list(ARMS), "ks": [0, 4, 16, 64, 128], "seeds": [0, 1],
             "overrides": ["trainer.lr=4e-4", "trainer.max_steps=300", "trainer.eval_every=25", "task.eval_size=200"]}
QUICK_GRID = {"arms": ["grpo", "tis_seq", "vcpo", "vcpo_ess_only", "vcpo_opob_only"], "ks": [0, 8, 32], "seeds": [0],
              "overrides": ["trainer.max_steps=60", "trainer.eval_every=10", "task.eval_size=200"]}
SWEEP_FILE = "sweep.json"
RESULTS_FILE = "results.jsonl"
ERROR_FILE = "error.txt"


class SweepError(ValueError):
    """A user-fixable problem with a sweep request (unknown arm, bad k); the message is one line."""


@dataclass(frozen=True)
class Cell:
    """One run of the grid: an arm at staleness k with a seed, in its own run directory."""

    arm: str
    k: int
    seed: int
    run_dir: Path

    @property
    def name(self) -> str:
        return f"{self.arm}_k{self.k}_s{self.seed}"


CellRunner = Callable[[Cell, list[str]], tuple[int, str]]
"""Runs one cell's command line; returns (exit status, tail of its stderr)."""


def run_subprocess(cell: Cell, argv: list[str]) -> tuple[int, str]:
    """The default runner: the command in a child process, stderr kept to report a failure."""
    from vcpo.runtime import set_parent_death_signal

    # The cell dies with the sweep however the sweep dies (no orphaned training runs).
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False,
                          preexec_fn=set_parent_death_signal)
    return proc.returncode, proc.stderr[-4000:]


def cell_argv(base_config: Path, cell: Cell, overrides: list[str]) -> list[str]:
    """The `vcpo train` command of a cell: base config, sweep-wide overrides, the arm, then the cell's own keys."""
    return [sys.executable, "-m", "vcpo.cli", "train", "-c", str(base_config), *overrides, *ARMS[cell.arm],
            "async.mode=lagged", f"async.max_staleness={cell.k}", f"seed={cell.seed}", f"run_dir={cell.run_dir}",
            "logging.progress=false", "runtime.torch_threads=1"]


def _check_grid(arms: list[str], ks: list[int], seeds: list[int]) -> None:
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SweepError(f"unknown arm {unknown[0]!r}; valid: {', '.join(ARMS)}")
    if not arms or not ks or not seeds:
        raise SweepError("the grid is empty: give at least one arm, one k and one seed")
    if min(ks) < 0:
        raise SweepError(f"staleness k must be >= 0, got {min(ks)}")


def prepare_warm_starts(base_config: Path, overrides: list[str], seeds: list[int]) -> None:
    """Build each seed's cached warm-started model once, here, so parallel cells never race to build it."""
    import torch

    from vcpo.config import load_config
    from vcpo.train.sft import warm_start

    for seed in seeds:
        config = load_config(base_config, [*overrides, f"seed={seed}", "logging.progress=false"])
        torch.set_num_threads(config.runtime.torch_threads)
        warm_start(config)


def run_sweep(
    base_config_path: str | Path,
    out_dir: str | Path,
    arms: list[str],
    ks: list[int],
    seeds: list[int],
    workers: int = 2,
    extra_overrides: list[str] | None = None,
    run_cell: CellRunner = run_subprocess,
    command: str = "",
    warm_start: bool = True,
) -> list[dict[str, Any]]:
    """Run every unfinished cell of the grid (at most ``workers`` at once), then collect all cells.

    Writes ``out_dir/sweep.json`` (command, date, machine, grid), ``out_dir/cells/ARM_kK_sS/`` per cell
    (a failed cell gets ``error.txt`` with its stderr tail; the sweep goes on) and ``out_dir/results.jsonl``
    (rewritten at the end, one line per cell). Returns the results lines.
    """
    from vcpo.config import load_config
    from vcpo.study.report import summarize_cell

    _check_grid(arms, ks, seeds)
    if workers < 1:
        raise SweepError(f"--workers must be >= 1, got {workers}")
    base = Path(base_config_path).resolve()
    out = Path(out_dir).resolve()
    # Children must find the parent's warm-start cache whatever their working directory.
    cache_dir = Path(load_config(base, extra_overrides).sft.cache_dir).resolve()
    overrides = [*(extra_overrides or []), f"sft.cache_dir={cache_dir}"]
    for arm in arms:  # validate every arm's config now, not 40 minutes into the sweep
        load_config(base, [*overrides, *ARMS[arm], "async.mode=lagged"])
    cells = [Cell(a, k, s, out / "cells" / f"{a}_k{k}_s{s}") for a in arms for k in ks for s in seeds]
    out.mkdir(parents=True, exist_ok=True)
    (out / SWEEP_FILE).write_text(json.dumps({
        "command": command, "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.node(), "cpu_count": os.cpu_count(), "base_config": str(base),
        "grid": {"arms": arms, "ks": ks, "seeds": seeds, "overrides": overrides, "workers": workers},
    }, indent=2))

    # Seed-major order: a sweep stopped part-way has whole seeds rather than whole arms.
    todo = sorted((c for c in cells if not (c.run_dir / "summary.json").is_file()), key=lambda c: c.seed)
    if todo and warm_start:
        prepare_warm_starts(base, overrides, sorted({c.seed for c in todo}))

    def one(cell: Cell) -> None:
        shutil.rmtree(cell.run_dir, ignore_errors=True)  # an interrupted cell restarts from scratch
        cell.run_dir.mkdir(parents=True, exist_ok=True)
        status, stderr_tail = run_cell(cell, cell_argv(base, cell, overrides))
        if status != 0 or not (cell.run_dir / "summary.json").is_file():
            (cell.run_dir / ERROR_FILE).write_text(f"exit status {status}\n{stderr_tail}")

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, todo))

    results = []
    for cell in cells:
        line: dict[str, Any] = {"cell": cell.name, "arm": cell.arm, "k": cell.k, "seed": cell.seed,
                                "run_dir": str(cell.run_dir)}
        if (cell.run_dir / "summary.json").is_file():
            line |= {"status": "done"} | summarize_cell(cell.run_dir)
        else:
            error = cell.run_dir / ERROR_FILE
            line |= {"status": "failed", "error": error.read_text()[-500:] if error.is_file() else ""}
        results.append(line)
    (out / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in results))
    return results
