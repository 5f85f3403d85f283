"""The run directory: which of its checkpoints are complete, what a fresh start or a resume may find there,
and creating it only once a run is sure to start (removing it again when the start fails). Torch-free, so
that a command checks all of this before any heavy import.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from vcpo.config import Config, ConfigError, save_config
from vcpo.errors import DiskError
from vcpo.metrics import METRICS_FILE
from vcpo.models.files import ModelLoadError, check_model_dir, declares_chat_template, no_chat_template
from vcpo.trackers import check_trackers

STEP_DIR = re.compile(r"^step_(\d{6,})$")
LATEST_FILE = "latest"
CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
TRAINED_GROUPS_FILE = "trained_groups.jsonl"
"""One line per trained group (vcpo.loop.trained_groups)."""
_STARTED_FILES = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, TRAINED_GROUPS_FILE, "tensorboard", "wandb", "mlflow.db",
                  "checkpoints")
"""What a run writes into its directory; a failed fresh start removes exactly these."""


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every finished checkpoint, oldest first; .tmp dirs of interrupted saves never match."""
    ckpt_root = Path(run_dir) / "checkpoints"
    found = []
    if ckpt_root.is_dir():
        for path in ckpt_root.iterdir():
            match = STEP_DIR.match(path.name)
            if match and path.is_dir() and (path / "trainer_state.json").is_file():
                found.append((int(match.group(1)), path))
    return sorted(found)


def resume_candidates(run_dir: Path) -> list[Path]:
    """The checkpoints to try, in order: the one ``latest`` names (if complete), then the others, newest first."""
    ckpt_root = Path(run_dir) / "checkpoints"
    newest_first = [path for _, path in reversed(complete_checkpoints(run_dir))]
    latest = ckpt_root / LATEST_FILE
    if latest.is_file():
        named = ckpt_root / latest.read_text(encoding="utf-8", errors="replace").strip()
        if named in newest_first:
            newest_first.remove(named)
            newest_first.insert(0, named)
    return newest_first


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint to resume from: the one ``latest`` names if it is complete, else the newest complete one."""
    candidates = resume_candidates(run_dir)
    return candidates[0] if candidates else None


def eval_target(path: Path) -> tuple[Path, Path | None]:
    """What ``vcpo eval PATH`` evaluates, and with which run's config: (model directory, that run's config.yaml).

    A run directory means its latest complete checkpoint; a checkpoint (``RUN/checkpoints/step_N``) brings its run's
    config.yaml; any other model directory has no run (None).
    """
    path = Path(path)
    if (path / CONFIG_FILE).is_file() and (path / "checkpoints").is_dir():
        checkpoint = latest_checkpoint(path)
        if checkpoint is None:
            raise ConfigError(f"run directory {str(path)!r} has no complete checkpoint to evaluate")
        return checkpoint, path / CONFIG_FILE
    run = path.parent.parent
    if STEP_DIR.match(path.name) and path.parent.name == "checkpoints" and (run / CONFIG_FILE).is_file():
        return path, run / CONFIG_FILE
    return path, None


def check_writable(path: Path, key: str) -> None:
    """``DiskError`` naming ``key`` unless a file can be created in ``path`` (or in its nearest existing parent)."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{key} {str(path)!r}: {str(probe)!r} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=probe):  # unnamed on Linux: nothing is left behind
            pass
    except OSError as e:
        raise DiskError(probe, e) from None


def check_start(config: Config, resume: bool) -> None:
    """Everything about a start that needs no heavy import: the run directory, the model directory's files,
    that the places the run writes to accept files, that the trackers it reports to are installed. Raises a
    one-line ``UserError``."""
    check_trackers(config.logging.report_to)
    run_dir = Path(config.run_dir)
    if not resume and complete_checkpoints(run_dir):
        raise ConfigError(f"run_dir {str(run_dir)!r} already holds a run with checkpoints: continue it with "
                          f"--resume {run_dir}, or choose another run_dir")
    if config.model.path is not None:
        check_model_dir(config.model.path)
        if config.task.prompt_format == "chat" and declares_chat_template(config.model.path) is False:
            raise ModelLoadError(no_chat_template(config.model.path))
    check_writable(run_dir, "run_dir")
    if config.model.path is None:
        check_writable(Path(config.sft.cache_dir), "sft.cache_dir")


class RunDirectory:
    """Creates the run directory when a run starts and removes it again when that start fails.

    ``open`` (called once everything that can fail cheaply has been checked) writes ``config.yaml``
    atomically and removes ``summary.json`` (it marks a run that is over: completed or stopped); a fresh
    start also clears the metrics and trained groups an earlier, checkpoint-less run left. ``discard`` (on a
    failure before the first checkpoint of a fresh start) removes everything ``open`` and the run made,
    so that no directory remains that ``--resume`` would accept; a resumed run's directory is never removed.
    """

    def __init__(self, path: str | Path, resume: bool) -> None:
        self.path = Path(path)
        self.resume = resume
        self._existed = self.path.exists()
        self._opened = False

    def open(self, config: Config) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / SUMMARY_FILE).unlink(missing_ok=True)  # written again when the run ends
            if not self.resume:
                (self.path / METRICS_FILE).unlink(missing_ok=True)
                (self.path / TRAINED_GROUPS_FILE).unlink(missing_ok=True)
        except OSError as e:
            raise DiskError(self.path, e) from None
        self._opened = True
        save_config(config, self.path / CONFIG_FILE)

    def discard(self) -> None:
        """Undo a fresh start that never checkpointed; a no-op once a checkpoint exists or for a resume."""
        if not self._opened or self.resume or complete_checkpoints(self.path):
            return
        if not self._existed:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        for name in _STARTED_FILES:
            target = self.path / name
            if target.is_dir():
                shutil.rmtree(target, ignore_errors=True)
            else:
                target.unlink(missing_ok=True)
