"""The ``vcpo`` command line: sft, train, eval, plot, config, sweep, rerun, report, serve. Each error is one line
on stderr.

Exit status: 0 done; 2 a user error (bad config, path or disk), found before any heavy import where it can
be; 1 a run that started and could not go on; 3 a run that a health alarm stopped (trainer.on_alarm); 128 + signal
when SIGTERM (143) or SIGINT (130) stopped it.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

app = typer.Typer(
    help="vcpo: stable asynchronous RL for LLMs (off-policy objectives, ESS-scaled LR, OPOB).",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
)
console = Console(stderr=True, soft_wrap=True)  # a path in a message stays on one line, whatever the width

if TYPE_CHECKING:
    from vcpo.loop.signals import StopSignals

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML config file.")]
Overrides = Annotated[list[str] | None, typer.Argument(help="Dotted overrides, e.g. trainer.lr=1e-4 async.mode=sync "
                                                       "(every key: `vcpo config show`).")]


def _fail(exc: BaseException, code: int = 2) -> None:
    print(f"error: {exc}", file=sys.stderr)  # one line, never wrapped
    raise typer.Exit(code)


def _quiet_libraries() -> None:
    """After the cheap checks: the heavy import, with transformers' progress bars off (ours is the one that matters)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _load(config: Path | None, overrides: list[str] | None, resume: Path | None = None):
    from vcpo.config import ConfigError, load_config, load_run_config

    if resume is not None:
        saved = resume / "config.yaml"
        if not saved.is_file():
            raise ConfigError(f"--resume {str(resume)!r}: no config.yaml there (not a run directory)")
        return load_run_config(saved, [*(overrides or []), f"run_dir={resume}"])
    return load_config(config, overrides)  # no -c: the built-in defaults plus the overrides


@app.command()
def sft(
    config: ConfigOpt = None,
    overrides: Overrides = None,
    save: Annotated[Path | None, typer.Option("--save", help="Also copy the warm-started model here (to pin it).")]
    = None,
) -> None:
    """Warm-start the embedded default model by supervised fine-tuning (cached), and report accuracy."""
    from vcpo.errors import UserError

    try:
        cfg = _load(config, overrides)
        _quiet_libraries()
        import shutil

        import torch

        from vcpo.models.loading import load_policy
        from vcpo.runtime import resolve_device
        from vcpo.study.provenance import warm_start_hash
        from vcpo.tasks import make_task
        from vcpo.train.evaluate import evaluate_accuracy
        from vcpo.train.sft import warm_start

        torch.set_num_threads(cfg.runtime.torch_threads)
        path = warm_start(cfg)
        model, tokenizer = load_policy(path, cfg.model.dtype, resolve_device(cfg.model.device))
        task = make_task(cfg.task)
        acc = evaluate_accuracy(model, tokenizer, task, task.problems("eval", cfg.task.eval_size, seed=cfg.seed),
                                cfg.rollout.max_new_tokens, lm_head_fp32=cfg.model.lm_head_fp32)
        if save is not None:
            if save.exists():
                raise FileExistsError(f"--save {str(save)!r} already exists")
            path = Path(shutil.copytree(path, save))
        console.print(f"warm-started model: {path} (hash {warm_start_hash(path)})\n"
                      f"held-out greedy accuracy: {acc:.3f}")
    except (UserError, FileExistsError) as exc:
        _fail(exc)


@app.command()
def train(
    config: ConfigOpt = None,
    overrides: Overrides = None,
    resume: Annotated[Path | None, typer.Option("--resume", help="Continue the run in this directory.")] = None,
) -> None:
    """Train with RL: `vcpo train -c CONFIG.yaml [key.path=value ...] [--resume RUN_DIR]`.

    SIGTERM or SIGINT: the run checkpoints its last finished step and exits 143 or 130 (a second one exits at once).
    A health alarm with trainer.on_alarm=stop (or rollback out of retries) exits 3.
    """
    from vcpo.loop.signals import StopSignals

    try:
        with StopSignals() as signals:  # from the start: a signal during the heavy imports ends the command cleanly
            _train(config, overrides, resume, signals)
    finally:  # the command is over: a late signal must not turn its exit status into a kill
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)


def _train(config: Path | None, overrides: list[str] | None, resume: Path | None, signals: StopSignals) -> None:
    from vcpo.errors import HealthAlarm, RunFailed, RunInterrupted, UserError, signal_name
    from vcpo.loop.signals import ForcedExit, StopRequested

    try:
        from vcpo.train.run_dir import check_start

        cfg = _load(config, overrides, resume)
        check_start(cfg, resume=resume is not None)  # all before the heavy import below
        with signals.interruptible():
            _quiet_libraries()
            from vcpo.loop.health import describe
            from vcpo.loop.trainer import train as run_training
        summary = run_training(cfg, resume=resume is not None, signals=signals)
        console.print(describe(summary), markup=False, highlight=False)
    except UserError as exc:
        _fail(exc)
    except HealthAlarm as exc:
        _fail(exc, code=HealthAlarm.EXIT_CODE)
    except RunFailed as exc:
        _fail(exc, code=1)
    except RunInterrupted as exc:
        print(exc, file=sys.stderr)
        raise typer.Exit(exc.exit_code) from None
    except StopRequested:
        print(f"interrupted by {signal_name(signals.signum)} before the run started; nothing was written",
              file=sys.stderr)
        raise typer.Exit(128 + signals.signum) from None
    except ForcedExit as exc:  # a second signal while the first one's checkpoint was being written
        print(f"exited at once on a second {signal_name(exc.signum)}", file=sys.stderr)
        raise typer.Exit(128 + exc.signum) from None


@app.command("eval")
def evaluate(
    model_path: Annotated[Path, typer.Argument(help="A Hugging Face model directory, a run's checkpoint, or a run "
                                               "directory (its latest checkpoint).")],
    config: ConfigOpt = None,
    overrides: Overrides = None,
    samples: Annotated[int, typer.Option("--samples", min=0, help="Samples per problem for mean@N and pass@N "
                                         "(0 = greedy only).")] = 8,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature of the N samples.")] = 0.8,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus mass of the N samples.")] = 0.7,
    dataset: Annotated[list[Path] | None, typer.Option("--dataset", help="A JSONL/Parquet file to evaluate on, "
                                                       "all of it (repeatable); default: the config's task.")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Where to write the JSON report (default: eval.json in "
                                             "MODEL_PATH).")] = None,
) -> None:
    """Greedy accuracy, mean@N and pass@N (unbiased estimator) of a model per dataset: JSON file and table.

    A checkpoint or run directory is evaluated with its run's config.yaml (task, eval_size, prompts, max_new_tokens)
    unless -c names another; overrides apply on top. Other model directories get the built-in defaults.
    """
    from vcpo.errors import UserError

    try:
        from vcpo.config import ConfigError
        from vcpo.models.files import check_model_dir
        from vcpo.train.run_dir import eval_target

        if not temperature > 0 or not 0 < top_p <= 1:
            raise ConfigError(f"--temperature must be > 0 and --top-p in (0, 1], got {temperature} and {top_p}")
        checkpoint, run_config = eval_target(model_path)
        cfg = _load(config or run_config, overrides)
        console.print(f"config: {config or run_config or 'built-in defaults'}"
                      + (" (the run's own; -c to use another)" if config is None and run_config else ""),
                      markup=False, highlight=False)
        if (Path(checkpoint) / "adapter_config.json").is_file():
            raise UserError(f"{checkpoint} is a LoRA adapter: `vcpo export {checkpoint} --out DIR --merge`, then "
                            f"evaluate DIR")
        check_model_dir(checkpoint)
        out = out if out is not None else model_path / "eval.json"
        for path in dataset or []:
            if not path.is_file():
                raise ConfigError(f"--dataset {str(path)!r} is not a file")
        _quiet_libraries()
        from vcpo.train.eval_report import run_eval, write_report
        from vcpo.train.evaluate import EvalSettings

        settings = EvalSettings(cfg.rollout.max_new_tokens, samples, temperature, top_p, seed=cfg.seed,
                                lm_head_fp32=cfg.model.lm_head_fp32)
        write_report(run_eval(cfg, checkpoint, dataset or [], settings), out, Console())
    except UserError as exc:
        _fail(exc)


@app.command()
def plot(run_dir: Annotated[Path, typer.Argument(help="A run directory holding metrics.jsonl.")]) -> None:
    """Write PNG figures (reward, eval accuracy, ESS ratio, grad norm, staleness, LR scale) of a run."""
    from vcpo.errors import UserError

    try:
        from vcpo.plots import plot_run

        paths = plot_run(run_dir)
        console.print("wrote " + ", ".join(str(p) for p in paths))
    except UserError as exc:
        _fail(exc)


config_app = typer.Typer(help="The config keys: values, defaults and descriptions.", no_args_is_help=True,
                         rich_markup_mode=None)
app.add_typer(config_app, name="config")


@config_app.command("show")
def config_show(config: ConfigOpt = None, overrides: Overrides = None) -> None:
    """Print every config key with its value, default and description: `vcpo config show [-c CONFIG] [key=value ...]`.

    Without -c: the built-in defaults (which are configs/quickstart.yaml's values).
    """
    from vcpo.errors import UserError

    try:
        from vcpo.config_reference import show

        cfg = _load(config, overrides)
        source = " ".join([str(config) if config else "built-in defaults", *(overrides or [])])
        sys.stdout.write(show(cfg, source))
    except UserError as exc:
        _fail(exc)


@config_app.command("docs")
def config_docs(
    out: Annotated[Path, typer.Option("--out", help="The Markdown file whose generated table to rewrite.")]
    = Path("docs/config.md"),
) -> None:
    """Regenerate the key reference in docs/config.md from the config models (a test fails when it is stale)."""
    from vcpo.config_reference import write_docs

    if not out.is_file():
        _fail(FileNotFoundError(f"--out {str(out)!r} does not exist (run from the repository root)"))
    try:
        changed = write_docs(out)
    except ValueError as exc:
        _fail(exc)
    console.print(f"{'updated' if changed else 'already current:'} {out}")


def _int_list(option: str, text: str | None) -> list[int] | None:
    from vcpo.study.sweep import SweepError

    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SweepError(f"{option} {text!r}: expected comma-separated integers, e.g. 0,4,16") from None


@app.command()
def sweep(
    config: ConfigOpt = None,
    overrides: Overrides = None,
    out: Annotated[Path, typer.Option("--out", help="Sweep directory (rerun to resume).")] = Path("runs/sweep"),
    grid: Annotated[str, typer.Option("--grid", help="A named grid: study2 (the staleness study), "
                                      "study3 (the staleness study on the multi-turn tool task), "
                                      "study2_mismatch (study2 with a simulated sampler/learner mismatch), study4 "
                                      "(study2 at a 5.1M-parameter model), heldout (decimal sums, where issue 46's "
                                      "recommendation is tested), study1 (issue 5's), quick.")] = "study2",
    quick: Annotated[bool, typer.Option("--quick", help="Same as --grid quick (< 10 minutes).")] = False,
    workers: Annotated[int, typer.Option("--workers", help="Cells run at once.")] = 2,
    arms: Annotated[str | None, typer.Option("--arms", help="Comma-separated arms (default: the grid's).")] = None,
    ks: Annotated[str | None, typer.Option("--ks", help="Comma-separated staleness values k.")] = None,
    seeds: Annotated[str | None, typer.Option("--seeds", help="Comma-separated seeds.")] = None,
    warm_starts: Annotated[str | None, typer.Option("--warm-starts", help="Comma-separated pinned warm starts "
                                                    "of the grid, e.g. w0 (default: all).")] = None,
) -> None:
    """Run a grid of (warm start x seed x arm x staleness k) in lagged mode: `vcpo sweep --grid study2 --out DIR`."""
    from vcpo.errors import UserError
    from vcpo.study.grids import GRIDS
    from vcpo.study.sweep import SweepError, run_sweep

    try:
        name = "quick" if quick else grid
        if name not in GRIDS:
            raise SweepError(f"--grid {grid!r}: unknown grid; valid: {', '.join(GRIDS)}")
        preset = GRIDS[name]
        pins = preset.warm_starts
        if warm_starts is not None:
            unknown = [w for w in warm_starts.split(",") if w not in pins]
            if unknown:
                raise SweepError(f"--warm-starts: {unknown[0]!r} is not a warm start of grid {name!r} "
                                 f"(it has: {', '.join(pins) or 'none'})")
            pins = {w: pins[w] for w in warm_starts.split(",")}
        _quiet_libraries()
        results = run_sweep(
            config or Path(preset.base_config), out, arms=arms.split(",") if arms else preset.arms,
            ks=_int_list("--ks", ks) or preset.ks, seeds=_int_list("--seeds", seeds) or preset.seeds,
            workers=workers, extra_overrides=[*preset.overrides, *(overrides or [])],
            command=" ".join(["vcpo", *sys.argv[1:]]), warm_starts=pins,
            auto_ks=_int_list("--ks", ks) or preset.auto_ks,
        )
        failed = [r["cell"] for r in results if r["status"] != "done"]
        console.print(f"{len(results) - len(failed)} of {len(results)} cells done; results in {out / 'results.jsonl'}"
                      + (f"; failed: {', '.join(failed)} (see error.txt in each)" if failed else ""))
    except (UserError, SweepError) as exc:
        _fail(exc)


@app.command()
def rerun(
    cell_dir: Annotated[Path, typer.Argument(help="A finished cell, e.g. benchmarks/staleness/study2/cells/NAME.")],
    out: Annotated[Path, typer.Option("--out", help="Where to run it again (a new directory).")],
    steps: Annotated[int | None, typer.Option("--steps", help="Rerun only the first N steps.")] = None,
    model: Annotated[Path | None, typer.Option("--model", help="The warm start, if not at its recorded path "
                                               "(its hash must match).")] = None,
) -> None:
    """Train a committed study cell again and compare its metrics with the committed ones (exit 1 if they differ)."""
    from vcpo.errors import UserError
    from vcpo.study.rerun import RerunError, rerun_cell

    try:
        _quiet_libraries()
        result = rerun_cell(cell_dir, out, steps=steps, model=model)
    except (UserError, RerunError) as exc:
        _fail(exc)
    digest = result.get("digest")
    verdict = "identical" if result["identical"] else "DIFFERENT"
    console.print(f"{verdict}: {result['values_compared']} values over {result['steps_compared']} steps, "
                  f"{result['mismatches']} differ" + (f"; first: {result['first_mismatch']}"
                                                      if result["first_mismatch"] else "")
                  + (f"; metrics digest committed {digest['committed']}, rerun {digest['rerun']}" if digest else "")
                  + f" (details: {out / 'compare.json'})")
    if not result["identical"]:
        raise typer.Exit(1)


@app.command()
def report(sweep_dir: Annotated[Path, typer.Argument(help="A directory written by `vcpo sweep`, or one run's "
                                                      "run_dir.")]) -> None:
    """Write REPORT.md and PNG figures for a sweep: tables, collapse, early warning, claims checked. For one run:
    print what it trained against what it generated (groups' length and pass rate, trained - generated)."""
    from vcpo.errors import UserError
    from vcpo.study.bias import run_report
    from vcpo.study.report import ReportError, write_report

    try:
        if (sweep_dir / "cells").is_dir():
            console.print(f"wrote {write_report(sweep_dir)}")
        else:
            print(run_report(sweep_dir), end="")
    except (UserError, ReportError, FileNotFoundError) as exc:
        _fail(exc)


@app.command()
def serve(
    model_dir: Annotated[Path, typer.Argument(help="A local Hugging Face model directory.")],
    host: Annotated[str, typer.Option(help="Interface to bind; the default serves this machine only.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.", min=1, max=65535)] = 8000,
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float64.")] = "float32",
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    seed: Annotated[int, typer.Option(help="Seed of the sampling RNG (requests may bring their own).")] = 0,
) -> None:
    """Serve MODEL_DIR over HTTP for rollouts (vLLM's completion shapes, pause, resume, update_weights)."""
    from vcpo.errors import UserError
    from vcpo.models.files import check_model_dir

    try:
        check_model_dir(model_dir)  # before the heavy import
        try:
            from vcpo.serve.app import run_server
        except ImportError as exc:
            raise UserError(f"vcpo serve needs the serve extra (pip install -e '.[serve]'): {exc}") from None
        _quiet_libraries()
        run_server(model_dir, host=host, port=port, dtype=dtype, device=device, seed=seed)
    except UserError as exc:
        _fail(exc)


@app.command("export")
def export(
    checkpoint: Annotated[Path, typer.Argument(help="A run's checkpoint directory (RUN/checkpoints/step_N).")],
    out: Annotated[Path, typer.Option("--out", help="The model directory to write (must not exist, or be empty).")],
    merge: Annotated[bool, typer.Option("--merge", help="LoRA: fold the adapter into the base weights (a plain "
                                        "model any loader reads); without it, the base and the adapter side by "
                                        "side in peft's layout.")] = False,
    base: Annotated[Path | None, typer.Option("--base", help="LoRA: the base model directory, if the one the "
                                              "checkpoint names has moved.")] = None,
) -> None:
    """Write a checkpoint as a Hugging Face model directory (AutoModelForCausalLM.from_pretrained loads it)."""
    from vcpo.errors import UserError

    try:
        _quiet_libraries()
        from vcpo.models.export import export_checkpoint

        written = export_checkpoint(checkpoint, out, merge=merge, base=base)
        console.print(f"wrote {written}", markup=False, highlight=False)
    except UserError as exc:
        _fail(exc)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
