"""The training loop: warm start, then per step: batch from the rollout source -> learner step ->
publish weights -> metrics, periodic evaluation and atomic checkpoints. Mode- and objective-blind.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from vcpo.config import Config, ConfigError, save_config
from vcpo.metrics import MetricsLogger, truncate_metrics
from vcpo.models.loading import declares_chat_template, load_policy
from vcpo.orchestration import LaggedSource, ProblemStream, RolloutContext, RolloutSource, SyncSource
from vcpo.orchestration.staleness import staleness_metrics
from vcpo.rollout.engine import HFRolloutEngine
from vcpo.runtime import configure_cpu, resolve_device
from vcpo.tasks import make_task, prepare_scoring
from vcpo.tasks.prompts import check_prompt_format, missing_chat_template
from vcpo.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from vcpo.train.evaluate import EvalSettings
from vcpo.train.evaluate import evaluate as evaluate_policy
from vcpo.train.learner import Learner
from vcpo.train.sft import warm_start
from vcpo.types import Batch, SamplingParams, Trajectory

console = Console(stderr=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def batch_metrics(trajectories: list[Trajectory], learner_version: int) -> dict[str, float]:
    """Reward, group-variance and length statistics of the trajectories a step trains on, and how many of their
    rewards are zeros the scorer forced: ``reward/errors`` (it raised or its process crashed), ``reward/timeouts``
    (killed at ``task.reward_timeout_s``)."""
    rewards = torch.tensor([t.reward for t in trajectories])
    by_group: dict[int, list[float]] = {}
    for t in trajectories:
        by_group.setdefault(t.group_id, []).append(t.reward)
    zero_var = sum(1 for r in by_group.values() if max(r) == min(r))
    lengths = torch.tensor([len(t.response_ids) for t in trajectories], dtype=torch.float32)
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "reward/zero_var_group_frac": zero_var / max(len(by_group), 1),
        "reward/errors": float(sum(t.reward_status in ("error", "crash") for t in trajectories)),
        "reward/timeouts": float(sum(t.reward_status == "timeout" for t in trajectories)),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": float(sum(not t.finished for t in trajectories) / len(trajectories)),
        "batch/size": float(len(trajectories)),
    } | staleness_metrics(trajectories, learner_version)


def make_source(config: Config, learner: Learner, tokenizer, task, model_path: Path) -> RolloutSource:
    """The run's rollout source: sync, lagged or async, wrapped in TBA's replay buffer when it is on."""
    source = _generating_source(config, learner, tokenizer, task, model_path)
    replay = config.async_.replay
    if not replay.enabled:
        return source
    from vcpo.orchestration.replay import ReplayBuffer, ReplaySource

    buffer = ReplayBuffer(replay.capacity, replay.recent_fraction, replay.priority_inv_temp, replay.max_uses,
                          max_age=config.async_.max_staleness, seed=config.seed)
    return ReplaySource(source, buffer, replay.groups_per_step or config.rollout.prompts_per_step)


def _generating_source(config: Config, learner: Learner, tokenizer, task, model_path: Path) -> RolloutSource:
    rc = config.rollout
    sampling = SamplingParams(temperature=rc.temperature, top_p=rc.top_p, max_new_tokens=rc.max_new_tokens)
    mode = config.async_.mode
    if mode == "async":
        from vcpo.orchestration.async_local import AsyncSource, WorkerSpec

        spec = WorkerSpec(
            worker_id=0, model_path=str(model_path), dtype=config.model.dtype, device=str(learner.device),
            lm_head_fp32=config.model.lm_head_fp32, task_name=config.task.name,
            task_kwargs=dict(config.task.kwargs), seed=config.seed, prompts_per_step=rc.prompts_per_step,
            group_size=rc.group_size, sampling=sampling, inflight_updates=config.async_.inflight_updates,
            torch_threads=config.runtime.torch_threads, reward_timeout_s=config.task.reward_timeout_s,
            reward_workers=config.task.reward_workers,
            task_options=config.task.model_dump(exclude={"name", "kwargs", "reward_timeout_s", "reward_workers"}),
        )
        return AsyncSource(learner.model, spec, config.async_.num_workers, config.async_.generation_bound(),
                           config.async_.drop_older_than, start_version=learner.version)
    engine = HFRolloutEngine(learner.model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                             lm_head_fp32=config.model.lm_head_fp32)
    ctx = RolloutContext(tokenizer, task, ProblemStream(task, config.seed, rc.prompts_per_step), sampling,
                         rc.group_size, config.seed)
    if mode == "sync":
        return SyncSource(engine, ctx)
    return LaggedSource(engine, ctx, config.async_.generation_bound())


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), console=console, transient=False, disable=not enabled,
    )


def train(config: Config, resume: bool = False) -> dict[str, Any]:
    """Run (or resume) the job in ``config.run_dir``; returns the run summary (also in summary.json)."""
    configure_cpu(config.runtime.torch_threads)
    device = resolve_device(config.model.device)
    run_dir = Path(config.run_dir)
    if not resume and latest_checkpoint(run_dir) is not None:
        raise ConfigError(f"run_dir {str(run_dir)!r} already holds a run with checkpoints: continue it with "
                          f"--resume {run_dir}, or choose another run_dir")
    seed_everything(config.seed)
    task = make_task(config.task)  # a malformed dataset fails here, before anything is written
    if config.task.prompt_format == "chat" and declares_chat_template(config.model.path) is False:
        raise missing_chat_template(config.model.path)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir / "config.yaml")
    prepare_scoring(task)  # the sandboxed scorer starts while the model loads
    model_path = warm_start(config)
    model, tokenizer = load_policy(model_path, config.model.dtype, device)
    learner = Learner(model, config)
    eval_problems = task.problems("eval", config.task.eval_size, seed=config.seed)
    check_prompt_format(tokenizer, eval_problems, str(model_path))

    tc = config.trainer
    eval_settings = EvalSettings(config.rollout.max_new_tokens, tc.eval_samples, tc.eval_temperature, tc.eval_top_p,
                                 seed=config.seed, lm_head_fp32=config.model.lm_head_fp32)
    eval_metrics: dict[str, float] = {}

    def evaluate() -> float:
        """Greedy accuracy; the whole eval dict (mean@N, pass@N with trainer.eval_samples) kept in eval_metrics."""
        eval_metrics.clear()
        eval_metrics.update(evaluate_policy(model, tokenizer, task, eval_problems, eval_settings))
        return eval_metrics["eval/accuracy"]

    state: dict[str, Any] = {}
    ckpt = latest_checkpoint(run_dir) if resume else None
    if ckpt is not None:
        state = load_checkpoint(ckpt, model, learner.optimizer)
        learner.version = int(state["step"])
        truncate_metrics(run_dir / "metrics.jsonl", after_step=learner.version)
        console.print(f"resuming {run_dir} from step {learner.version} ({ckpt.name})")
    elif resume:
        console.print(f"no checkpoint in {run_dir}: starting from step 0")
    if not resume or ckpt is None:
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    initial_accuracy = state.get("initial_accuracy")
    if initial_accuracy is None:
        initial_accuracy = evaluate()
        console.print(f"held-out accuracy before RL: {initial_accuracy:.3f}")

    source = make_source(config, learner, tokenizer, task, model_path)
    if "source" in state:
        source.load_state(state["source"])
    start = time.perf_counter()
    last_accuracy = state.get("last_accuracy", initial_accuracy)

    def checkpoint() -> None:
        save_checkpoint(run_dir, learner.version, model, tokenizer, learner.optimizer, {
            "step": learner.version, "initial_accuracy": initial_accuracy, "last_accuracy": last_accuracy,
            "source": source.state(),
        })

    try:
        with (
            MetricsLogger(run_dir, tensorboard=config.logging.tensorboard) as logger,
            _progress(config.logging.progress) as bar,
        ):
            task_id = bar.add_task("train", total=tc.max_steps, completed=learner.version, info="")
            last = False
            while not last and learner.version < tc.max_steps:
                t0 = time.perf_counter()
                trajectories = source.next_batch(learner.version)
                t_rollout = time.perf_counter() - t0
                metrics = batch_metrics(trajectories, learner.version)
                batch = Batch.from_trajectories(trajectories, pad_id=tokenizer.pad_token_id)
                metrics |= learner.step(batch)
                source.publish(model, learner.version)
                metrics |= source.metrics()
                step = learner.version
                elapsed_s = time.perf_counter() - start
                last = step == tc.max_steps or (tc.max_time_s is not None and elapsed_s >= tc.max_time_s)
                if last or (tc.eval_every and step % tc.eval_every == 0):
                    last_accuracy = evaluate()
                    metrics |= eval_metrics
                if step == 1:
                    metrics["eval/accuracy_initial"] = initial_accuracy
                metrics |= {"step": step, "time/rollout_wait_s": t_rollout, "time/step_s": time.perf_counter() - t0}
                logger.log(metrics)
                bar.update(task_id, completed=step, info=(
                    f"reward {metrics['reward/mean']:.2f}  ess {metrics['ess/ratio']:.2f}  "
                    f"stale {metrics['staleness/max']:.0f}  acc {last_accuracy:.2f}"))
                if tc.checkpoint_every and step % tc.checkpoint_every == 0 and not last:
                    checkpoint()
            checkpoint()
    except BaseException:
        if learner.version > int(state.get("step", 0)):
            checkpoint()  # a crash or Ctrl-C keeps every finished step
            console.print(f"interrupted: checkpoint saved at step {learner.version}; resume with --resume {run_dir}")
        raise
    finally:
        source.close()

    summary = {
        "run_dir": str(run_dir), "steps": learner.version, "initial_accuracy": initial_accuracy,
        "final_accuracy": last_accuracy, "wall_time_s": time.perf_counter() - start,
        "objective": config.objective.name, "mode": config.async_.mode, "max_staleness": config.async_.max_staleness,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
