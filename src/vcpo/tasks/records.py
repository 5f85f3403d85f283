"""Reading local dataset files (JSONL, Parquet) into (question, reference answer) records, with one error per
malformed record naming the file and line (or row). Light imports only: config validation uses this module."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vcpo.errors import UserError
from vcpo.rewards.answers import after_hashes, last_boxed, normalize_number

DATASET_TASKS = ("jsonl", "parquet")
DATASET_KWARGS = ("path", "train_path", "eval_path", "prompt_field", "answer_field", "answer_format", "eval_fraction")
ANSWER_FORMATS = ("auto", "gsm8k", "boxed", "plain")
PROMPT_FIELDS = ("question", "problem", "prompt")  # tried in this order when prompt_field is unset
ANSWER_FIELDS = ("answer", "solution")
PARQUET_HINT = "pip install -e '.[parquet]' (or pip install pyarrow)"


class DatasetError(UserError, ValueError):
    """A dataset file or setting that cannot be used; one line naming the file and line (or the config key)."""


@dataclass(frozen=True)
class Record:
    """One problem of a dataset file: its question, its reference final answer, and where it came from."""

    question: str
    answer: str
    where: str  # "path:line" (JSONL) or "path row N" (Parquet), for messages


def check_dataset_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """Raise :class:`DatasetError` for unknown ``task.kwargs`` keys, a missing or doubled path, a path that is not a
    file, or a bad ``answer_format`` / ``eval_fraction``: cheap checks that run when the config is loaded."""
    for key in kwargs:
        if key not in DATASET_KWARGS:
            raise DatasetError(f"task.kwargs.{key}: not a setting of task {name!r} "
                               f"(valid: {', '.join(DATASET_KWARGS)})")
    single, split = "path" in kwargs, ("train_path" in kwargs, "eval_path" in kwargs)
    if single == any(split) or (any(split) and not all(split)):
        raise DatasetError(f"task {name!r} needs task.kwargs.path, or both task.kwargs.train_path and "
                           f"task.kwargs.eval_path (got {', '.join(sorted(kwargs)) or 'neither'})")
    for key in ("path", "train_path", "eval_path"):
        if key in kwargs and not Path(str(kwargs[key])).is_file():
            raise DatasetError(f"task.kwargs.{key}: {str(kwargs[key])!r} is not a file")
    if kwargs.get("answer_format", "auto") not in ANSWER_FORMATS:
        raise DatasetError(f"task.kwargs.answer_format: {kwargs['answer_format']!r} is not one of "
                           f"{', '.join(ANSWER_FORMATS)}")
    fraction = kwargs.get("eval_fraction", 0.1)
    if not isinstance(fraction, int | float) or not 0 < fraction < 1:
        raise DatasetError(f"task.kwargs.eval_fraction: must be a number in (0, 1), got {fraction!r}")


def read_rows(path: Path, kind: str) -> list[tuple[str, Any]]:
    """``(where, row)`` of every record of a JSONL (blank lines skipped) or Parquet file, in file order. A file
    ending in ``.parquet`` or ``.jsonl`` is read as such whatever ``kind`` (the task's name) says."""
    kind = {".parquet": "parquet", ".jsonl": "jsonl"}.get(path.suffix, kind)
    if kind == "parquet":
        return _parquet_rows(path)
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rows.append((where, json.loads(line)))
            except ValueError as exc:
                raise DatasetError(f"{where}: not valid JSON ({getattr(exc, 'msg', exc)})") from None
    return rows


def _parquet_rows(path: Path) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"task.name=parquet needs pyarrow, which is not installed: {PARQUET_HINT}") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:
        detail = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise DatasetError(f"{path}: not a readable Parquet file ({detail})") from None
    return [(f"{path} row {i}", row) for i, row in enumerate(table.to_pylist(), 1)]


def read_records(path: Path, kind: str, prompt_field: str | None = None, answer_field: str | None = None,
                 answer_format: str = "auto") -> list[Record]:
    """The records of one file, each with its reference answer extracted (see :func:`reference_of`).

    Unset field names are taken from the first record: the prompt is its first field of :data:`PROMPT_FIELDS`, the
    answer its first of :data:`ANSWER_FIELDS`. ``answer_format="auto"`` reads GSM8K (``question`` + ``answer``:
    the text after ``####``), MATH solutions (``solution``: the last ``\\boxed{}``) and anything else as the final
    answer itself (its ``\\boxed{}`` when it has one). Raises :class:`DatasetError` naming the file and line.
    """
    rows = read_rows(path, kind)
    if not rows:
        raise DatasetError(f"{path}: no records (empty file)")
    first_where, first = rows[0]
    if not isinstance(first, dict):
        raise DatasetError(f"{first_where}: a record must be a JSON object, got {type(first).__name__}")
    prompt_field = prompt_field or _first_present(first, PROMPT_FIELDS, first_where, "prompt_field")
    answer_field = answer_field or _first_present(first, ANSWER_FIELDS, first_where, "answer_field")
    if answer_format == "auto":
        answer_format = ("boxed" if answer_field == "solution" else
                         "gsm8k" if (prompt_field, answer_field) == ("question", "answer") else "plain")
    records = []
    for where, row in rows:
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: a record must be a JSON object, got {type(row).__name__}")
        question = _field(row, prompt_field, where, "prompt_field")
        answer = reference_of(_field(row, answer_field, where, "answer_field"), answer_format, answer_field, where)
        records.append(Record(question, answer, where))
    return records


def reference_of(text: str, answer_format: str, field: str, where: str) -> str:
    """The final answer in a record's answer field: after ``####`` (gsm8k), the last balanced ``\\boxed{}`` (boxed),
    or the text itself, its ``\\boxed{}`` if it has one (plain); thousands separators dropped (``1,000`` -> 1000)."""
    if answer_format == "gsm8k":
        answer = after_hashes(text)
        if answer is None:
            raise DatasetError(f"{where}: field {field!r} has no '#### <answer>' final answer (GSM8K format; "
                               "set task.kwargs.answer_format if the file is not GSM8K)")
        return normalize_number(answer)
    boxed = last_boxed(text)
    if "\\boxed" in text and boxed is None:
        raise DatasetError(f"{where}: field {field!r} has an unbalanced \\boxed{{ (no closing brace)")
    if answer_format == "boxed" and boxed is None:
        raise DatasetError(f"{where}: field {field!r} has no \\boxed{{...}} final answer (MATH format)")
    answer = (boxed if boxed is not None else text).strip()
    if not answer:
        raise DatasetError(f"{where}: field {field!r} is empty")
    return normalize_number(answer)


def _first_present(row: dict[str, Any], fields: tuple[str, ...], where: str, key: str) -> str:
    for name in fields:
        if name in row:
            return name
    raise DatasetError(f"{where}: none of the fields {', '.join(fields)} (the record has {', '.join(row) or 'none'}; "
                       f"set task.kwargs.{key})")


def _field(row: dict[str, Any], name: str, where: str, key: str) -> str:
    if name not in row:
        raise DatasetError(f"{where}: no field {name!r} (the record has {', '.join(row) or 'none'}; "
                           f"set task.kwargs.{key})")
    value = row[name]
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise DatasetError(f"{where}: field {name!r} must be a string or a number, got {type(value).__name__}")
    return str(value)
