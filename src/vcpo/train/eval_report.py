"""``vcpo eval``: greedy accuracy, mean@N and pass@N of a model per dataset, written to JSON and shown as a table."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from vcpo.config import Config, TaskConfig
from vcpo.models.loading import load_policy
from vcpo.runtime import resolve_device
from vcpo.tasks import make_task
from vcpo.tasks.prompts import check_prompt_format
from vcpo.tasks.records import DATASET_TASKS
from vcpo.train.evaluate import EvalSettings, evaluate


def dataset_task_config(config: Config, path: Path) -> TaskConfig:
    """The task of one ``--dataset`` file: every record held out (the file is its own eval split), read with the
    config's field names and answer format when the config's task is a dataset too, and its prompt settings."""
    kind = "parquet" if path.suffix == ".parquet" else "jsonl"
    fields = {k: v for k, v in config.task.kwargs.items() if k in ("prompt_field", "answer_field", "answer_format")}
    fields = fields if config.task.name in DATASET_TASKS else {}
    return config.task.model_copy(update={"name": kind, "kwargs": {"train_path": str(path), "eval_path": str(path),
                                                                     **fields}})


def run_eval(config: Config, model_path: Path, datasets: list[Path], settings: EvalSettings) -> dict[str, Any]:
    """Evaluate ``model_path`` on each of ``datasets`` (files; none = the config's task's eval split), at most
    ``task.eval_size`` problems each; returns the report that ``vcpo eval`` writes."""
    task_configs = {path.stem: dataset_task_config(config, path) for path in datasets} or {
        config.task.name: config.task}
    tasks = {name: make_task(tc) for name, tc in task_configs.items()}  # a DatasetTask checks its own kwargs
    model, tokenizer = load_policy(model_path, config.model.dtype, resolve_device(config.model.device))
    results: dict[str, Any] = {}
    for name, task in tasks.items():
        problems = task.problems("eval", config.task.eval_size, seed=config.seed)
        check_prompt_format(tokenizer, problems, str(model_path))
        start = time.perf_counter()
        metrics = evaluate(model, tokenizer, task, problems, settings)
        results[name] = {"problems": len(problems), **{k.removeprefix("eval/"): v for k, v in metrics.items()},
                         "time_s": round(time.perf_counter() - start, 2)}
    return {"model": str(model_path), "samples": settings.samples, "temperature": settings.temperature,
            "top_p": settings.top_p, "max_new_tokens": settings.max_new_tokens, "seed": settings.seed,
            "prompt_format": config.task.prompt_format, "datasets": results}


def write_report(report: dict[str, Any], out: Path, console: Console) -> None:
    """Write ``report`` to ``out`` (JSON) and print it as a table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    n = report["samples"]
    table = Table(title=f"{report['model']}: greedy, and {n} samples at T={report['temperature']}, "
                        f"top-p={report['top_p']}" if n else f"{report['model']}: greedy")
    columns = ["problems", "accuracy", *([f"mean@{n}", f"pass@{n}"] if n else [])]
    table.add_column("dataset")
    for column in columns:
        table.add_column("greedy accuracy" if column == "accuracy" else column, justify="right")
    for name, row in report["datasets"].items():  # a multi-turn task has no mean@N / pass@N (greedy episodes only)
        table.add_row(name, *(str(row[c]) if c == "problems" else f"{row[c]:.3f}" if c in row else "-"
                              for c in columns))
    console.print(table)
    console.print(f"written to {out}")
