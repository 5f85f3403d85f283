"""`vcpo rerun CELL_DIR`: train a committed study cell again from its saved config and pinned warm start, and
compare the new metrics with the committed ones (bit for bit through the metrics digest when the whole run is
repeated; to the exported precision step by step otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vcpo.metrics import read_metrics
from vcpo.study.export import rounded
from vcpo.study.provenance import TIME_PREFIX, ProvenanceError, metrics_digest, read_cell_record, warm_start_hash

COMPARE_FILE = "compare.json"


class RerunError(ValueError):
    """A cell that cannot be rerun as committed (no config, warm start missing or changed); one line."""


def compare_metrics(committed: list[dict[str, Any]], rerun: list[dict[str, Any]]) -> dict[str, Any]:
    """Step-by-step comparison of two runs' metrics, on the committed run's keys (wall-clock ``time/*`` aside).

    Values are compared after :func:`vcpo.study.export.rounded` (idempotent, so exported and raw runs compare
    alike). Only the steps both runs reached count. Returns the counts, the first mismatch (step, key, both
    values) and the largest absolute difference per key that differed.
    """
    by_step = {r["step"]: r for r in rerun if "step" in r}
    compared = mismatches = 0
    first = None
    worst: dict[str, float] = {}
    steps = 0
    for old in committed:
        new = by_step.get(old.get("step"))
        if new is None:
            continue
        steps += 1
        for key, value in old.items():
            if key.startswith(TIME_PREFIX):
                continue
            compared += 1
            if rounded(value) == rounded(new.get(key)):
                continue
            mismatches += 1
            if first is None:
                first = {"step": old["step"], "key": key, "committed": value, "rerun": new.get(key)}
            if isinstance(value, int | float) and isinstance(new.get(key), int | float):
                worst[key] = max(worst.get(key, 0.0), abs(float(value) - float(new[key])))
    return {"steps_compared": steps, "values_compared": compared, "mismatches": mismatches,
            "first_mismatch": first, "max_abs_diff": worst}


def _model_path(cell_dir: Path, record: dict[str, Any] | None, model: Path | None) -> list[str]:
    """The ``model.path`` override: the given or recorded warm start, checked against the recorded hash."""
    ws = (record or {}).get("warm_start")
    if model is None and (ws is None or not ws.get("path")):
        return ["model.path=null"]  # predates provenance: the config's own SFT recipe, unverifiable
    path = Path(model if model is not None else ws["path"])
    try:
        found = warm_start_hash(path)
    except ProvenanceError as exc:
        raise RerunError(f"cell {cell_dir.name}: warm start: {exc}") from None
    if ws is not None and ws.get("hash") and found != ws["hash"]:
        raise RerunError(f"cell {cell_dir.name} was run from warm start {ws['id']!r} of hash {ws['hash']}, but "
                         f"{str(path)!r} hashes to {found}")
    return [f"model.path={path.resolve()}"]


def rerun_cell(cell_dir: str | Path, out_dir: str | Path, steps: int | None = None,
               model: str | Path | None = None) -> dict[str, Any]:
    """Rerun a cell into ``out_dir`` (which must not hold a run) and compare; writes ``out_dir/compare.json``.

    ``steps`` reruns only the first steps (a cheap check; lagged mode reproduces any prefix exactly). The
    cell's ``cell.json`` names its warm start and hash; a cell without one (written before provenance was
    recorded) reruns from the SFT recipe in its config, cached in the default cache directory.
    """
    from vcpo.config import load_run_config
    from vcpo.loop.trainer import train

    cell_dir, out = Path(cell_dir), Path(out_dir)
    if not (cell_dir / "config.yaml").is_file() or not (cell_dir / "metrics.jsonl").is_file():
        raise RerunError(f"{str(cell_dir)!r} is not a finished study cell (needs config.yaml and metrics.jsonl)")
    if out.exists() and any(out.iterdir()):
        raise RerunError(f"--out {str(out)!r} is not empty: choose a new directory for the rerun")
    record = read_cell_record(cell_dir)
    committed = read_metrics(cell_dir / "metrics.jsonl")
    full_steps = max(r["step"] for r in committed)
    if steps is not None and not 0 < steps <= full_steps:
        raise RerunError(f"--steps {steps}: the committed run has steps 1 to {full_steps}")
    overrides = [f"run_dir={out}", "logging.progress=false", "sft.cache_dir=.cache/vcpo",
                 *_model_path(cell_dir, record, Path(model) if model is not None else None)]
    if steps is not None:
        overrides.append(f"trainer.max_steps={steps}")
    train(load_run_config(cell_dir / "config.yaml", overrides))
    rerun = read_metrics(out / "metrics.jsonl")
    result = {"cell": str(cell_dir), "rerun_dir": str(out), "steps": steps or full_steps} | compare_metrics(
        [r for r in committed if r["step"] <= (steps or full_steps)], rerun)
    committed_digest = (record or {}).get("metrics_digest")
    if committed_digest and (steps is None or steps == full_steps):
        result["digest"] = {"committed": committed_digest, "rerun": metrics_digest(rerun)}
    digest_ok = "digest" not in result or result["digest"]["committed"] == result["digest"]["rerun"]
    result["identical"] = result["mismatches"] == 0 and digest_ok
    (out / COMPARE_FILE).write_text(json.dumps(result, indent=2) + "\n")
    return result
