"""The ``vcpo`` command line: sft, train, eval, plot. User errors exit non-zero with one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(
    help="vcpo: stable asynchronous RL for LLMs (off-policy objectives, ESS-scaled LR, OPOB).",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
)
console = Console(stderr=True)

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML config file.")]
Overrides = Annotated[list[str] | None, typer.Argument(help="Dotted overrides, e.g. trainer.lr=1e-4 async.mode=sync")]


def _user_errors() -> tuple[type[BaseException], ...]:
    from vcpo.checkpoint import CheckpointError
    from vcpo.config import ConfigError
    from vcpo.models.loading import ModelLoadError
    from vcpo.plots import PlotError
    from vcpo.tasks.base import TaskError

    return ConfigError, ModelLoadError, TaskError, CheckpointError, PlotError


def _fail(exc: BaseException) -> None:
    print(f"error: {exc}", file=sys.stderr)  # one line, never wrapped
    raise typer.Exit(2)


def _load(config: Path | None, overrides: list[str] | None, resume: Path | None = None):
    from vcpo.config import ConfigError, load_config

    if resume is not None:
        saved = resume / "config.yaml"
        if not saved.is_file():
            raise ConfigError(f"--resume {str(resume)!r}: no config.yaml there (not a run directory)")
        return load_config(saved, [*(overrides or []), f"run_dir={resume}"])
    return load_config(config, overrides)  # no -c: the built-in defaults plus the overrides


@app.command()
def sft(config: ConfigOpt = None, overrides: Overrides = None) -> None:
    """Warm-start the embedded default model by supervised fine-tuning (cached), and report accuracy."""
    try:
        import torch

        from vcpo.models.loading import load_policy
        from vcpo.sft import evaluate_accuracy, warm_start
        from vcpo.tasks import make_task

        cfg = _load(config, overrides)
        torch.set_num_threads(cfg.runtime.torch_threads)
        path = warm_start(cfg)
        model, tokenizer = load_policy(path, cfg.model.dtype)
        task = make_task(cfg.task)
        acc = evaluate_accuracy(model, tokenizer, task, task.problems("eval", cfg.task.eval_size, seed=cfg.seed),
                                cfg.rollout.max_new_tokens)
        console.print(f"warm-started model: {path}\nheld-out greedy accuracy: {acc:.3f}")
    except _user_errors() as exc:
        _fail(exc)


@app.command()
def train(
    config: ConfigOpt = None,
    overrides: Overrides = None,
    resume: Annotated[Path | None, typer.Option("--resume", help="Continue the run in this directory.")] = None,
) -> None:
    """Train with RL: `vcpo train -c CONFIG.yaml [key.path=value ...] [--resume RUN_DIR]`."""
    try:
        from vcpo.trainer import train as run_training

        cfg = _load(config, overrides, resume)
        summary = run_training(cfg, resume=resume is not None)
        console.print(
            f"held-out accuracy: {summary['initial_accuracy']:.3f} before RL -> {summary['final_accuracy']:.3f} "
            f"after {summary['steps']} steps ({summary['wall_time_s']:.0f} s); run: {summary['run_dir']}"
        )
    except _user_errors() as exc:
        _fail(exc)


@app.command("eval")
def evaluate(
    model_path: Annotated[Path, typer.Argument(help="A Hugging Face model directory (e.g. a checkpoint).")],
    config: ConfigOpt = None,
    overrides: Overrides = None,
) -> None:
    """Greedy accuracy of a model on the held-out split of the configured task."""
    try:
        from vcpo.models.loading import load_policy
        from vcpo.sft import evaluate_accuracy
        from vcpo.tasks import make_task

        cfg = _load(config, overrides)
        model, tokenizer = load_policy(model_path, cfg.model.dtype)
        task = make_task(cfg.task)
        acc = evaluate_accuracy(model, tokenizer, task, task.problems("eval", cfg.task.eval_size, seed=cfg.seed),
                                cfg.rollout.max_new_tokens)
        print(json.dumps({"model": str(model_path), "task": cfg.task.name, "eval/accuracy": acc}))
    except _user_errors() as exc:
        _fail(exc)


@app.command()
def plot(run_dir: Annotated[Path, typer.Argument(help="A run directory holding metrics.jsonl.")]) -> None:
    """Write PNG figures (reward, eval accuracy, ESS ratio, grad norm, staleness, LR scale) of a run."""
    try:
        from vcpo.plots import plot_run

        paths = plot_run(run_dir)
        console.print("wrote " + ", ".join(str(p) for p in paths))
    except _user_errors() as exc:
        _fail(exc)


def main() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress display is the one that matters
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
