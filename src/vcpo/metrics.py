"""The one metrics path (STYLE.md §7): flat namespaced dicts appended to ``run_dir/metrics.jsonl``.

The trackers of ``logging.report_to`` (vcpo.trackers) receive the same dicts; plots, reports and resume read only
the JSONL.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from vcpo.errors import DiskError, UserError

if TYPE_CHECKING:
    from vcpo.trackers import MetricsSink

METRICS_FILE = "metrics.jsonl"


class MetricsError(UserError):
    """A user-visible problem with a metrics file or a metrics dict; the message is one line naming it."""


def _jsonable(key: str, value: Any) -> Any:
    """One metric value as JSON: non-finite floats become null so the file stays strict JSON."""
    if value is None or isinstance(value, bool | int | str):
        return value
    try:
        number = float(value)  # also accepts numpy scalars and 0-d tensors
    except (TypeError, ValueError):
        raise MetricsError(f"metric {key!r} has non-numeric value {value!r} of type {type(value).__name__}") from None
    return number if math.isfinite(number) else None


def fsync_dir(directory: Path) -> None:
    """Flush a directory entry to disk, so that a rename inside it survives a power loss (POSIX only)."""
    if os.name == "posix":
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _step_of(record: dict[str, Any]) -> float:
    """A line's step; a line without an integer step sorts after every step, so truncation drops it."""
    step = record.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else math.inf


def _drop_torn_tail(path: Path) -> None:
    """Cut an unfinished last line (a crash mid-write) so that the next append starts on a fresh line."""
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)
            f.flush()
            os.fsync(f.fileno())


class MetricsLogger:
    """Appends one JSON object per optimizer step to ``run_dir/metrics.jsonl``, durably.

    Each line is flushed and fsync'ed before ``log`` returns, so a crash loses no finished line.
    Then each of ``sinks`` (the trackers, ``vcpo.trackers.open_trackers``) gets the line's numbers, keyed as in
    the line, with its ``step``; the sinks' owner closes them.
    """

    def __init__(self, run_dir: Path, sinks: Sequence[MetricsSink] = ()) -> None:
        run_dir = Path(run_dir)
        self.path = run_dir / METRICS_FILE
        self.sinks = list(sinks)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                _drop_torn_tail(self.path)
            self._file = open(self.path, "a", encoding="utf-8")  # held open across steps; close() closes it
        except OSError as e:
            raise DiskError(self.path, e) from None

    def log(self, metrics: dict[str, float | int]) -> None:
        """Append ``metrics`` (which must hold an integer ``step``) as one line; NaN/inf are written as null."""
        if self._file.closed:
            raise MetricsError(f"MetricsLogger for {self.path} is closed")
        step = metrics.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise MetricsError(f"metrics dict needs an integer 'step', got {step!r}")
        record = {key: _jsonable(key, value) for key, value in metrics.items()}
        try:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as e:
            raise DiskError(self.path, e) from None
        numbers = {key: value for key, value in record.items()
                   if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)}
        for sink in self.sinks:
            sink.write(step, numbers)

    def close(self) -> None:
        """Close the JSONL file; safe to call twice, and after a failed write."""
        try:
            self._file.close()
        except OSError:  # the buffered tail of a failed write: log() already raised for it
            pass

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _parse_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(raw line, parsed dict) for each line; a torn last line is dropped, a bad line elsewhere is an error."""
    if not path.is_file():
        raise MetricsError(f"metrics file not found: {path}")
    lines = path.read_text(encoding="utf-8").splitlines()
    parsed = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # a crash mid-write leaves at most the last line unfinished
                break
            raise MetricsError(f"{path}:{number}: not a JSON object: {line[:80]!r}") from None
        if not isinstance(record, dict):
            raise MetricsError(f"{path}:{number}: not a JSON object: {line[:80]!r}")
        parsed.append((line, record))
    return parsed


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All metric dicts of a JSONL file in order (null stays None); tolerates a truncated last line."""
    return [record for _, record in _parse_lines(Path(path))]


def truncate_metrics(path: Path, after_step: int) -> int:
    """Atomically rewrite ``path`` keeping only lines with ``step <= after_step``; returns the lines kept.

    Used on resume from the checkpoint of ``after_step``, so that no step appears twice. A missing
    file is left missing (a run that crashed before its first log) and 0 is returned.
    """
    path = Path(path)
    if not path.exists():
        return 0
    kept = [line for line, record in _parse_lines(path) if _step_of(record) <= after_step]
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)  # make the rename itself durable
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DiskError(path, e) from None
    return len(kept)
