"""Where a study cell came from: the code's git commit and dirty flag, the warm-start model's content hash,
and a digest of the run's deterministic metrics, kept per cell in ``cell.json``.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

CELL_FILE = "cell.json"
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
"""With the ``*.safetensors`` weights, the files that decide what a model directory computes."""
UNHASHED_CONFIG_KEYS = ("transformers_version",)
"""Written by whatever library version saved the directory; the model is the same without them."""
TIME_PREFIX = "time/"


class ProvenanceError(ValueError):
    """A model directory that cannot be hashed (missing, no weights); the message is one line."""


def warm_start_hash(model_dir: str | Path) -> str:
    """A 16-hex-digit SHA-256 of a model directory's weights, architecture and tokenizer.

    Hashes the bytes of every ``*.safetensors`` file and of ``tokenizer.json``, and ``config.json`` /
    ``tokenizer_config.json`` as sorted JSON without :data:`UNHASHED_CONFIG_KEYS`, so a directory re-saved
    by another transformers release hashes alike while any changed weight bit does not.
    """
    root = Path(model_dir)
    weights = sorted(root.glob("*.safetensors"))
    if not weights:
        raise ProvenanceError(f"{str(root)!r} holds no *.safetensors weights (not a model directory)")
    digest = hashlib.sha256()
    for path in [*weights, *(root / name for name in MODEL_FILES if (root / name).is_file())]:
        data = path.read_bytes()
        if path.name.endswith("config.json"):
            tree = {k: v for k, v in json.loads(data).items() if k not in UNHASHED_CONFIG_KEYS}
            data = json.dumps(tree, sort_keys=True).encode()
        digest.update(path.name.encode() + b"\0" + hashlib.sha256(data).digest())
    return digest.hexdigest()[:16]


def git_state(where: str | Path | None = None) -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": bool or None}`` of the checkout holding ``where`` (default: this
    package's source, i.e. the code that runs). Dirty means tracked files differ from the commit; None
    values mean no git checkout (an installed package) or no git."""
    where = Path(where) if where is not None else Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def metrics_digest(records: list[dict[str, Any]]) -> str:
    """SHA-256 (16 hex digits) of a run's metrics without its wall-clock keys (``time/*``).

    JSON writes floats with the shortest repr that round-trips, so two runs share a digest exactly when
    every deterministic metric of every step is bit for bit the same (lagged mode on one machine type).
    """
    digest = hashlib.sha256()
    for record in records:
        kept = {k: v for k, v in record.items() if not k.startswith(TIME_PREFIX)}
        digest.update(json.dumps(kept, sort_keys=True).encode() + b"\n")
    return digest.hexdigest()[:16]


def read_cell_record(run_dir: str | Path) -> dict[str, Any] | None:
    """A cell's ``cell.json``, or None for a cell written before provenance was recorded."""
    path = Path(run_dir) / CELL_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def write_cell_record(run_dir: str | Path, record: dict[str, Any]) -> None:
    (Path(run_dir) / CELL_FILE).write_text(json.dumps(record, indent=2) + "\n")
