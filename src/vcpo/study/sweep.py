"""`vcpo sweep`: a grid of (warm start x seed x arm x staleness k) runs in deterministic-lag mode, each cell one
`vcpo train` subprocess, a bounded number at a time, resumable (a cell with summary.json is skipped), each cell
recording its provenance (commit, dirty flag, warm-start hash, metrics digest) in cell.json.

The grids and their costs are in :mod:`vcpo.study.grids`. An interrupted cell is rerun from its start (cells are
short; its partial run directory is overwritten).
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

from vcpo.metrics import read_metrics
from vcpo.study.grids import ARMS, WarmStartPin, is_auto
from vcpo.study.provenance import (
    ProvenanceError,
    git_state,
    metrics_digest,
    read_cell_record,
    warm_start_hash,
    write_cell_record,
)

SWEEP_FILE = "sweep.json"
RESULTS_FILE = "results.jsonl"
ERROR_FILE = "error.txt"


class SweepError(ValueError):
    """A user-fixable problem with a sweep request (unknown arm, bad k, a changed warm start); one line."""


@dataclass(frozen=True)
class Cell:
    """One run of the grid: an arm at staleness k with a seed (and a pinned warm start), in its own directory. The k
    of an adaptive arm (``async.max_staleness: auto``) is its upper bound ``async.auto.k_max``."""

    arm: str
    k: int
    seed: int
    run_dir: Path
    warm_start: str | None = None

    @property
    def name(self) -> str:
        middle = f"_{self.warm_start}" if self.warm_start else ""
        return f"{self.arm}_k{self.k}{middle}_s{self.seed}"


CellRunner = Callable[[Cell, list[str]], tuple[int, str]]
"""Runs one cell's command line; returns (exit status, tail of its stderr)."""


def run_subprocess(cell: Cell, argv: list[str]) -> tuple[int, str]:
    """The default runner: the command in a child process, stderr kept to report a failure."""
    from vcpo.runtime import set_parent_death_signal

    # The cell dies with the sweep however the sweep dies (no orphaned training runs).
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False,
                          preexec_fn=set_parent_death_signal)
    return proc.returncode, proc.stderr[-4000:]


def cell_argv(base_config: Path, cell: Cell, overrides: list[str], model_path: Path | None = None) -> list[str]:
    """The `vcpo train` command of a cell: base config, sweep-wide overrides, the arm, then the cell's own keys."""
    model = [f"model.path={model_path}"] if model_path is not None else []
    k = f"async.auto.k_max={cell.k}" if is_auto(cell.arm) else f"async.max_staleness={cell.k}"
    return [sys.executable, "-m", "vcpo.cli", "train", "-c", str(base_config), *overrides, *ARMS[cell.arm], *model,
            "async.mode=lagged", k, f"seed={cell.seed}", f"run_dir={cell.run_dir}",
            "logging.progress=false", "runtime.torch_threads=1"]


def _check_grid(arms: list[str], ks: list[int], seeds: list[int]) -> None:
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SweepError(f"unknown arm {unknown[0]!r}; valid: {', '.join(ARMS)}")
    if not arms or not ks or not seeds:
        raise SweepError("the grid is empty: give at least one arm, one k and one seed")
    if min(ks) < 0:
        raise SweepError(f"staleness k must be >= 0, got {min(ks)}")


def pinned_warm_starts(pins: dict[str, WarmStartPin], task: dict[str, Any]) -> dict[str, Path]:
    """Each pinned warm start's directory, after checking it exists, hashes as pinned and was trained on ``task``
    (``{"name", "kwargs"}``, compared with the ``task`` its ``sft.json`` records)."""
    paths = {}
    for ws, pin in pins.items():
        path = Path(pin.path).resolve()
        try:
            found = warm_start_hash(path)
        except ProvenanceError:
            raise SweepError(f"warm start {ws!r}: no model at {pin.path!r} (run vcpo sweep from the repository "
                             "root)") from None
        if found != pin.sha:
            raise SweepError(f"warm start {ws!r} at {pin.path!r} hashes to {found}, the grid pins {pin.sha}: the "
                             "committed model changed")
        recipe = json.loads((path / "sft.json").read_text()).get("task") if (path / "sft.json").is_file() else None
        if recipe is not None and recipe != task:
            raise SweepError(f"warm start {ws!r} was trained on task {recipe}, but the config's task is {task}")
        paths[ws] = path
    return paths


def prepare_warm_starts(base_config: Path, overrides: list[str], seeds: list[int]) -> dict[int, Path]:
    """Build each seed's cached warm-started model once, here, so parallel cells never race to build it."""
    import torch

    from vcpo.config import load_config
    from vcpo.train.sft import warm_start

    paths = {}
    for seed in seeds:
        config = load_config(base_config, [*overrides, f"seed={seed}", "logging.progress=false"])
        torch.set_num_threads(config.runtime.torch_threads)
        paths[seed] = warm_start(config)
    return paths


def _refuse_changed_warm_starts(cells: list[Cell], hashes: dict[str, str]) -> None:
    """A resumed sweep must not mix finished cells of one warm-start id trained from different models."""
    for cell in cells:
        record = read_cell_record(cell.run_dir) if (cell.run_dir / "summary.json").is_file() else None
        ws = (record or {}).get("warm_start") or {}
        if ws.get("id") in hashes and ws.get("hash") != hashes[ws["id"]]:
            raise SweepError(f"cell {cell.name} was run from warm start {ws['id']!r} of hash {ws.get('hash')}, "
                             f"now {hashes[ws['id']]}: use another --out, or delete the old cells")


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
    warm_starts: dict[str, WarmStartPin] | None = None,
    auto_ks: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Run every unfinished cell of the grid (at most ``workers`` at once), then collect all cells.

    With ``warm_starts`` every cell starts from a pinned model (``model.path``), one cell per pin x seed x arm
    x k; without, each seed's own SFT warm start (built here unless ``warm_start`` is False, for tests). An
    adaptive arm's cells take their k (its upper bound) from ``auto_ks`` (default: ``ks``).
    Writes ``out_dir/sweep.json`` (command, date, machine, commit, grid), ``out_dir/cells/NAME/`` per cell with
    ``cell.json`` (provenance; a failed cell also gets ``error.txt`` with its stderr tail and the sweep goes
    on) and ``out_dir/results.jsonl`` (rewritten at the end, one line per cell). Returns the results lines.
    """
    from vcpo.config import load_config
    from vcpo.study.report import summarize_cell

    _check_grid(arms, ks, seeds)
    auto_ks = auto_ks or ks
    ks_of = {arm: auto_ks if is_auto(arm) else ks for arm in arms}
    if workers < 1:
        raise SweepError(f"--workers must be >= 1, got {workers}")
    base = Path(base_config_path).resolve()
    out = Path(out_dir).resolve()
    # Children must find the parent's warm-start cache whatever their working directory.
    config = load_config(base, extra_overrides)
    overrides = [*(extra_overrides or []), f"sft.cache_dir={Path(config.sft.cache_dir).resolve()}"]
    for arm in arms:  # validate every arm's config now, not 40 minutes into the sweep
        for k in ks_of[arm] if is_auto(arm) else [None]:
            bound = [f"async.auto.k_max={k}"] if k is not None else []
            load_config(base, [*overrides, *ARMS[arm], "async.mode=lagged", *bound])
    pins = warm_starts or {}
    ws_paths = pinned_warm_starts(pins, {"name": config.task.name, "kwargs": config.task.kwargs})
    ws_hashes = {ws: pin.sha for ws, pin in pins.items()}
    cells = [Cell(a, k, s, out / "cells" / Cell(a, k, s, Path(), ws).name, ws)
             for ws in (list(pins) or [None]) for s in seeds for a in arms for k in ks_of[a]]
    git = git_state()
    out.mkdir(parents=True, exist_ok=True)
    (out / SWEEP_FILE).write_text(json.dumps({
        "command": command, "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.node(), "cpu_count": os.cpu_count(), "base_config": str(base), "git": git,
        "grid": {"arms": arms, "ks": ks, "auto_ks": auto_ks, "seeds": seeds, "overrides": overrides, "workers": workers,
                 "warm_starts": {ws: {"path": pin.path, "hash": pin.sha} for ws, pin in pins.items()}},
    }, indent=2))
    _refuse_changed_warm_starts(cells, ws_hashes)

    # Warm-start-major, then seed-major (the list's order): a sweep stopped part-way has whole seeds.
    todo = [c for c in cells if not (c.run_dir / "summary.json").is_file()]
    sft_paths: dict[int, Path] = {}
    if todo and warm_start and not pins:
        sft_paths = prepare_warm_starts(base, overrides, sorted({c.seed for c in todo}))

    def provenance(cell: Cell) -> dict[str, Any] | None:
        if cell.warm_start is not None:
            return {"id": cell.warm_start, "path": pins[cell.warm_start].path, "hash": ws_hashes[cell.warm_start]}
        if cell.seed in sft_paths:
            return {"id": f"sft-seed{cell.seed}", "path": str(sft_paths[cell.seed]),
                    "hash": warm_start_hash(sft_paths[cell.seed])}
        return None

    def one(cell: Cell) -> None:
        shutil.rmtree(cell.run_dir, ignore_errors=True)  # an interrupted cell restarts from scratch
        cell.run_dir.mkdir(parents=True, exist_ok=True)
        record = {"cell": cell.name, "arm": cell.arm, "k": cell.k, "seed": cell.seed,
                  "warm_start": provenance(cell), "git": git, "command": command,
                  "started": datetime.now(UTC).isoformat(timespec="seconds")}
        write_cell_record(cell.run_dir, record)
        argv = cell_argv(base, cell, overrides, ws_paths.get(cell.warm_start) if cell.warm_start else None)
        status, stderr_tail = run_cell(cell, argv)
        if status != 0 or not (cell.run_dir / "summary.json").is_file():
            (cell.run_dir / ERROR_FILE).write_text(f"exit status {status}\n{stderr_tail}")
            return
        record["metrics_digest"] = metrics_digest(read_metrics(cell.run_dir / "metrics.jsonl"))
        write_cell_record(cell.run_dir, record)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, todo))

    results = []
    for cell in cells:
        line: dict[str, Any] = {"cell": cell.name, "arm": cell.arm, "k": cell.k, "seed": cell.seed,
                                "warm_start": cell.warm_start, "run_dir": str(cell.run_dir)}
        if (cell.run_dir / "summary.json").is_file():
            line |= {"status": "done"} | summarize_cell(cell.run_dir)
        else:
            error = cell.run_dir / ERROR_FILE
            line |= {"status": "failed", "error": error.read_text()[-500:] if error.is_file() else ""}
        results.append(line)
    (out / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in results))
    return results
