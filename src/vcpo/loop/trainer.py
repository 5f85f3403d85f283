"""The training loop: warm start, then per step: batch from the rollout source -> learner step ->
publish weights -> metrics and the trained groups' prompts (trained_groups.jsonl), periodic evaluation and atomic
checkpoints. Mode- and objective-blind.

Everything that can fail is checked before the run directory is written; SIGTERM/SIGINT end the run
with a checkpoint of the last finished step; non-finite steps are skipped, counted, and stop the run
when ``trainer.max_skipped_steps`` come in a row. Health alarms (vcpo.loop.alarms) watch every step and, by
``trainer.on_alarm``, warn, stop the run, or roll it back to an earlier checkpoint with a lower learning rate.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from vcpo.config import Config, ServerConfig
from vcpo.errors import DiskError, HealthAlarm, RunFailed, RunInterrupted, signal_name
from vcpo.loop.alarms import REMEDIES, Alarm, HealthMonitor, accuracy_verdict
from vcpo.loop.health import RunHealth, ended
from vcpo.loop.signals import ForcedExit, StopRequested, StopSignals
from vcpo.loop.trained_groups import append_trained_groups, trained_group_records
from vcpo.metrics import METRICS_FILE, MetricsLogger, truncate_metrics
from vcpo.models.loading import load_policy
from vcpo.models.lora import apply_lora_config, is_lora, save_adapter_config
from vcpo.orchestration import LaggedSource, ProblemStream, RolloutContext, RolloutSource, SyncSource
from vcpo.orchestration.adaptive_staleness import adaptive_staleness
from vcpo.orchestration.filtering import DynamicSampling
from vcpo.orchestration.staleness import staleness_metrics
from vcpo.rollout.engine import HFRolloutEngine
from vcpo.runtime import configure_cpu, resolve_device
from vcpo.tasks import make_task, prepare_scoring
from vcpo.tasks.prompts import check_prompt_format
from vcpo.trackers import open_trackers
from vcpo.train.checkpoint import CheckpointError, discard_after, load_checkpoint, save_checkpoint, set_aside
from vcpo.train.evaluate import EvalSettings
from vcpo.train.evaluate import evaluate as evaluate_policy
from vcpo.train.learner import Learner
from vcpo.train.run_dir import SUMMARY_FILE, TRAINED_GROUPS_FILE, RunDirectory, complete_checkpoints, resume_candidates
from vcpo.train.sft import warm_start
from vcpo.types import Batch, Problem, SamplingParams, Trajectory

console = Console(stderr=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def batch_metrics(trajectories: list[Trajectory], learner_version: int) -> dict[str, float]:
    """Reward, group-variance and length statistics of the trajectories a step trains on, and how many of their
    rewards are zeros the scorer forced: ``reward/errors`` (it raised or its process crashed), ``reward/timeouts``
    (killed at ``task.reward_timeout_s``). Lengths count the model's own tokens (not environment observations);
    ``response/logprob_mean`` is the mean behavior log-prob of those tokens (minus it estimates the per-token
    entropy of the sampling policy; NaN log-probs of rows sampled from non-finite logits left out)."""
    rewards = torch.tensor([t.reward for t in trajectories])
    logprobs = [lp for t in trajectories for lp, m in zip(t.behavior_logprobs, t.model_token_mask(), strict=True)
                if m and math.isfinite(lp)]
    by_group: dict[int, list[float]] = {}
    for t in trajectories:
        by_group.setdefault(t.group_id, []).append(t.reward)
    zero_var = sum(1 for r in by_group.values() if max(r) == min(r))
    lengths = torch.tensor([sum(t.model_token_mask()) for t in trajectories], dtype=torch.float32)
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "reward/zero_var_group_frac": zero_var / max(len(by_group), 1),
        "reward/errors": float(sum(t.reward_status in ("error", "crash") for t in trajectories)),
        "reward/timeouts": float(sum(t.reward_status == "timeout" for t in trajectories)),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_frac": float(sum(not t.finished for t in trajectories) / len(trajectories)),
        "response/logprob_mean": sum(logprobs) / len(logprobs) if logprobs else math.nan,
        "batch/size": float(len(trajectories)),
        "batch/groups": float(len(by_group)),
    } | staleness_metrics(trajectories, learner_version) | tool_metrics(trajectories)


def tool_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Multi-turn episode statistics (none for single-turn batches): tool calls and model turns per episode, tool
    runs that failed (summed), void-turn episodes, and the fraction of response tokens masked as observations."""
    stats = [t.env_stats for t in trajectories if t.env_stats]
    if not stats:
        return {}
    total = sum(len(t.response_ids) for t in trajectories)
    masked = total - sum(sum(t.model_token_mask()) for t in trajectories)
    return {
        "tools/calls_per_episode": sum(s["tool_calls"] for s in stats) / len(stats),
        "tools/turns_mean": sum(s["turns"] for s in stats) / len(stats),
        "tools/errors": float(sum(s["tool_errors"] for s in stats)),
        "tools/void_frac": sum(s["void"] for s in stats) / len(stats),
        "tools/masked_frac": masked / max(total, 1),
    }


def make_source(config: Config, learner: Learner, tokenizer, task, model_path: Path, backend=None,
                servers: ServerConfig | None = None) -> RolloutSource:
    """The run's rollout source: sync, lagged or async, wrapped in TBA's replay buffer when it is on. ``servers``:
    ``rollout.server`` with the URLs of the servers the run launched (default: ``rollout.server`` itself)."""
    source = _generating_source(config, learner, tokenizer, task, model_path, backend, servers or config.rollout.server)
    replay = config.async_.replay
    if not replay.enabled:
        return source
    from vcpo.orchestration.replay import ReplayBuffer, ReplaySource

    buffer = ReplayBuffer(replay.capacity, replay.recent_fraction, replay.priority_inv_temp, replay.max_uses,
                          max_age=config.async_.initial_staleness(), seed=config.seed)
    return ReplaySource(source, buffer, replay.groups_per_step or config.rollout.prompts_per_step,
                        inner_follows_bound=config.async_.generation_follows_bound())


def dynamic_sampling(config: Config) -> DynamicSampling | None:
    """``rollout.filter`` as every source applies it (None: ``none``, every group is trained)."""
    rc = config.rollout
    return None if rc.filter == "none" else DynamicSampling(rc.prompts_per_step, rc.filter_max_factor,
                                                             rc.filter_pass_rate)


def _generating_source(config: Config, learner: Learner, tokenizer, task, model_path: Path, backend,
                       server: ServerConfig) -> RolloutSource:
    rc = config.rollout
    sampling = dynamic_sampling(config)
    params = SamplingParams(temperature=rc.temperature, top_p=rc.top_p, max_new_tokens=rc.max_new_tokens)
    mode = config.async_.mode
    servers = _server_engine(config, server, model_path, learner.model, tokenizer) if rc.engine == "server" else None
    if mode == "async":
        from vcpo.orchestration.async_local import AsyncSource, WorkerSpec

        spec = WorkerSpec(
            worker_id=0, model_path=str(model_path), dtype=config.model.dtype, device=str(learner.device),
            lm_head_fp32=config.model.lm_head_fp32, task_name=config.task.name,
            task_kwargs=dict(config.task.kwargs), seed=config.seed, prompts_per_step=rc.prompts_per_step,
            group_size=rc.group_size, sampling=params, inflight_updates=config.async_.inflight_updates,
            torch_threads=config.runtime.torch_threads, reward_timeout_s=config.task.reward_timeout_s,
            reward_workers=config.task.reward_workers, parent_pid=os.getpid(),
            handoff_timeout_s=config.async_.handoff_timeout_s,
            server=None if servers is None else server.model_dump(),
            task_options=config.task.model_dump(exclude={"name", "kwargs", "reward_timeout_s", "reward_workers"}),
            lora=config.model.lora.model_dump() if config.model.lora.rank > 0 else None,
        )
        if backend is not None:  # Ray: rollout actors (vcpo.orchestration.ray)
            return backend.source(learner.model, spec, start_version=learner.version,
                                  publisher=None if servers is None else servers.publisher, sampling=sampling)
        ac = config.async_
        return AsyncSource(learner.model, spec, ac.num_workers, ac.generation_bound(), ac.drop_older_than,
                           start_version=learner.version, max_restarts=ac.max_worker_restarts,
                           publisher=None if servers is None else servers.publisher, sampling=sampling,
                           batch_order=ac.batch_order)
    engine = servers or HFRolloutEngine(learner.model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                                        lm_head_fp32=config.model.lm_head_fp32)
    remote_model = None if servers is None else learner.model  # whose weights are published to the servers
    ctx = RolloutContext(tokenizer, task, ProblemStream(task, config.seed, rc.prompts_per_step), params,
                         rc.group_size, config.seed)
    if mode == "sync":
        return SyncSource(engine, ctx, remote_model, sampling)
    return LaggedSource(engine, ctx, config.async_.generation_bound(), remote_model, sampling)


def _server_engine(config: Config, sc: ServerConfig, model_path: Path, model: torch.nn.Module, tokenizer):
    """The inference-server engine of ``sc``, publishing into ``weights_dir`` and checking after each update that
    every server gives a fixed sequence the learner's log-probs (docs/server.md)."""
    from vcpo.rollout.server import WeightCheck, server_engine

    weights_dir = sc.weights_dir or str(Path(config.run_dir) / "server_weights")
    extra = [p for p in (model_path / "config.json", model_path / "generation_config.json") if p.is_file()]
    if is_lora(model):  # each version is the adapters' tensors; vcpo serve builds the adapters from their config
        extra.append(save_adapter_config(model, Path(weights_dir)))
    vocab = min(int(model.config.vocab_size), len(tokenizer))  # ids both the model and the server's tokenizer know
    check = None if sc.weight_check_tol is None else WeightCheck(model, WeightCheck.probe(vocab), sc.weight_check_tol)
    return server_engine(sc, weights_dir=weights_dir, extra_files=extra, abort=config.async_.inflight_updates
                         or config.async_.mode != "async", check=check, lora=is_lora(model))


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), console=console, transient=False, disable=not enabled,
    )


def say(message: str) -> None:
    console.print(message, markup=False, highlight=False, soft_wrap=True)


def restore(run_dir: Path, learner: Learner) -> tuple[dict[str, Any], Path | None]:
    """Load the newest complete and loadable checkpoint into the learner: ``(trainer_state, its dir)``.

    A corrupt or incomplete one (truncated weights, bad JSON, a missing optimizer file) is skipped with a
    warning naming it; when every one fails, ``CheckpointError`` names them all. No checkpoint: ``({}, None)``.
    """
    skipped = []
    for ckpt in resume_candidates(run_dir):
        try:
            state = load_checkpoint(ckpt, learner.model, learner.optimizer)
        except CheckpointError as e:
            say(f"warning: skipping checkpoint {ckpt.name}: {e}")
            skipped.append(ckpt.name)
            continue
        learner.version = int(state["step"])
        return state, ckpt
    if skipped:
        raise CheckpointError(f"no loadable checkpoint in {str(run_dir)!r}: {', '.join(skipped)} all failed to load")
    return {}, None


def train(config: Config, resume: bool = False, signals: StopSignals | None = None) -> dict[str, Any]:
    """Run (or resume) the job in ``config.run_dir``; returns the run summary (also in summary.json).

    With ``async.backend: ray`` the run holds a Ray session (started or joined) and its actors are gone after it,
    however it ends; the loop below does not know which backend it drives.
    """
    if config.async_.backend == "local":
        return _train(config, resume, signals, backend=None)
    from vcpo.orchestration.ray import RayBackend

    with RayBackend(config) as backend:
        return _train(config, resume, signals, backend)


def make_learner(config: Config, model: torch.nn.Module, model_path: Path, backend, closing: ExitStack) -> Learner:
    """The run's learner: this process's, ``backend``'s learner group, or trainer.num_learners local processes (closed
    by ``closing``; one, sharded, is a world of one rank), the last two mirrored by ``model``."""
    if backend is not None:
        return backend.learner(model, str(model_path))
    if config.trainer.num_learners == 1 and config.trainer.sharding == "none":
        return Learner(model, config)
    from vcpo.orchestration.local_learners import LocalLearnerGroup

    group = LocalLearnerGroup(model, config, str(model_path))
    closing.callback(group.close)
    return group


def _train(config: Config, resume: bool, signals: StopSignals | None, backend) -> dict[str, Any]:
    """The run on the local backend, or on ``backend``'s learner group and rollout actors.

    The model, task and checkpoint are loaded before anything is written to the run directory, and a
    fresh start that fails before its first finished step removes what it wrote. Raises ``RunFailed``
    (non-finite streak, rollout workers lost) and ``RunInterrupted`` (SIGTERM/SIGINT), both after keeping
    every finished step that is sound. ``signals``: the caller's handlers, if it installed them earlier.
    """
    with nullcontext(signals) if signals is not None else StopSignals() as signals, ExitStack() as closing:
        try:
            with signals.interruptible():  # nothing is written yet: a signal may end the start at once
                configure_cpu(config.runtime.torch_threads)
                device = resolve_device(config.model.device)
                run = RunDirectory(config.run_dir, resume)
                seed_everything(config.seed)
                task = make_task(config.task)
                prepare_scoring(task)  # the sandboxed scorer starts while the model loads
                model_path = warm_start(config)
                model, tokenizer = load_policy(model_path, config.model.dtype, device)
                model = apply_lora_config(model, config.model.lora)  # rank 0: the model as it is
                learner = make_learner(config, model, model_path, backend, closing)
                state, ckpt = restore(run.path, learner) if resume else ({}, None)
                eval_problems = task.problems("eval", config.task.eval_size, seed=config.seed)
                check_prompt_format(tokenizer, eval_problems, str(model_path))
        except StopRequested:
            raise RunInterrupted(f"interrupted by {signal_name(signals.signum)} before the run started; nothing "
                                 f"was written", signals.signum) from None
        start_step = learner.version
        run.open(config)  # the first write to the run directory: everything above could still fail
        try:
            if ckpt is not None:
                truncate_metrics(run.path / METRICS_FILE, after_step=learner.version)
                truncate_metrics(run.path / TRAINED_GROUPS_FILE, after_step=learner.version)
                say(f"resuming {run.path} from step {learner.version} ({ckpt.name})")
            else:
                if resume:
                    say(f"no checkpoint in {run.path}: starting from step 0")
                (run.path / METRICS_FILE).unlink(missing_ok=True)
                (run.path / TRAINED_GROUPS_FILE).unlink(missing_ok=True)
            return _Job(config, run.path, learner, tokenizer, task, eval_problems, state, signals,
                        backend).run(model_path)
        except BaseException:
            if learner.version == start_step:
                run.discard()  # a fresh start with no finished step leaves nothing behind
            raise


class _Job:
    """One process's share of a run: the loop, its checkpoints and its ending (completed, stopped, interrupted)."""

    def __init__(self, config: Config, run_dir: Path, learner: Learner, tokenizer: Any, task: Any,
                 eval_problems: list[Problem], state: dict[str, Any], signals: StopSignals, backend=None) -> None:
        self.config, self.run_dir, self.learner, self.tokenizer, self.task = config, run_dir, learner, tokenizer, task
        self.eval_problems, self.state, self.signals, self.backend = eval_problems, state, signals, backend
        self.start_step = self.saved_step = self.logged_step = learner.version
        self.health = RunHealth.from_state(state.get("health"))
        self.monitor = HealthMonitor(config.trainer.health, state.get("alarms"),
                                     vocab_size=int(learner.model.config.vocab_size))
        learner.lr = config.trainer.lr * self.monitor.lr_factor  # a rollback's lower rate survives a resume
        # stop and rollback checkpoint every step that raised no alarm, and keep enough of them to go back before
        # the dead-policy rule's streak
        self.guarded = config.trainer.on_alarm != "warn"
        keep = config.trainer.keep_checkpoints
        self.keep = max(keep, config.trainer.health.dead_steps + 2) if self.guarded and keep is not None else keep
        self.bound = adaptive_staleness(config.async_, state.get("staleness"))  # None for a fixed k
        self.initial_accuracy: float | None = state.get("initial_accuracy")
        self.last_accuracy: float | None = state.get("last_accuracy", self.initial_accuracy)
        self.source: RolloutSource | None = None
        self.evaluated_at = learner.version if self.initial_accuracy is not None else -1
        self.started = time.perf_counter()
        tc = config.trainer
        self.eval_settings = EvalSettings(config.rollout.max_new_tokens, tc.eval_samples, tc.eval_temperature,
                                          tc.eval_top_p, seed=config.seed, lm_head_fp32=config.model.lm_head_fp32)
        self.eval_metrics: dict[str, float] = {}

    def evaluate(self) -> float:
        """Greedy accuracy; the whole evaluation (with ``eval/mean@N``, ``eval/pass@N`` when trainer.eval_samples
        is N > 0) is kept in ``eval_metrics`` for the step's metrics line."""
        self.eval_metrics = evaluate_policy(self.learner.model, self.tokenizer, self.task, self.eval_problems,
                                            self.eval_settings) | {"eval/problems": len(self.eval_problems)}
        self.evaluated_at = self.learner.version
        return self.eval_metrics["eval/accuracy"]

    def evaluate_the_end(self) -> None:
        """A run that stops early (a health alarm, a non-finite streak) is evaluated as it ends, unless its last
        evaluation saw these weights: its summary then says whether it ended worse than it started."""
        if self.evaluated_at == self.learner.version or self.initial_accuracy is None:
            return
        try:
            with self.signals.interruptible():
                self.last_accuracy = self.evaluate()
        except Exception as e:  # the failure being reported matters more than this evaluation
            say(f"warning: the final evaluation failed ({type(e).__name__}: {e}); the summary keeps the last one")

    def run(self, model_path: Path) -> dict[str, Any]:
        launched = None
        try:
            launched = self.launch_servers(model_path)  # they start up while the model is evaluated
            if self.initial_accuracy is None:
                say(f"evaluating the starting model on {len(self.eval_problems)} held-out problems before step 1")
                t0 = time.perf_counter()
                with self.signals.interruptible():
                    self.initial_accuracy = self.last_accuracy = self.evaluate()
                say(f"held-out accuracy before RL: {self.initial_accuracy:.3f} ({time.perf_counter() - t0:.1f}s)")
            if self.config.async_.mode == "async" and self.learner.version == 0:
                n = self.config.async_.num_workers
                say(f"starting {n} rollout worker{'s' if n > 1 else ''}: each loads the model and the task's scorer "
                    f"before step 1's first batch (seconds to a minute on a CPU)")
            servers = None
            if launched is not None:
                with self.signals.interruptible():
                    urls = launched.wait_healthy()
                say(f"rollout servers up: {', '.join(urls)} (logs in {launched.log_dir})")
                servers = self.config.rollout.server.model_copy(update={"urls": urls, "launch": None})
            self.open_source(model_path, servers)
            lc = self.config.logging
            with open_trackers(lc.report_to, self.run_dir, lc.project, lc.run_name or self.run_dir.name,
                               self.config.to_dict()) as sinks:  # one tracker run across rollbacks
                while True:
                    try:
                        with MetricsLogger(self.run_dir, sinks) as logger, _progress(lc.progress) as bar:
                            self.loop(logger, bar)
                        break
                    except _Rollback as rollback:
                        self.roll_back(rollback.alarms)
                        self.open_source(model_path, servers)
            self.checkpoint()
        except HealthAlarm as e:  # the last step no rule flagged is checkpointed already
            self.evaluate_the_end()
            summary = self.finish(f"stopped: {e}")
            raise HealthAlarm(f"stopped at step {self.learner.version}: {e}; {self.kept()}{ended(summary)}") from None
        except StopRequested:
            sig = signal_name(self.signals.signum)
            if self.learner.version == self.start_step:
                raise RunInterrupted(f"interrupted by {sig} before a step finished; nothing new was kept",
                                     self.signals.signum) from None
            self.checkpoint()  # no summary.json: the run is not over (a sweep takes one as a finished cell)
            raise RunInterrupted(f"interrupted by {sig} after step {self.learner.version}: {self.kept()}",
                                 self.signals.signum) from None
        except ForcedExit as e:
            raise RunInterrupted(f"exited at once on a second {signal_name(e.signum)}: {self.kept()}",
                                 e.signum) from None
        except RunFailed as e:
            self.checkpoint()
            self.set_aside_suspect()
            policy = self.health.consecutive_skipped > 0  # a non-finite streak, not a lost worker or rank
            if policy:
                self.evaluate_the_end()
            summary = self.finish(f"stopped: {e}")
            raise RunFailed(f"stopped at step {self.learner.version}: {e}; {self.kept()}"
                            f"{ended(summary) if policy else ''}") from None
        except DiskError:  # a full or read-only disk refuses the checkpoint too: the previous one stays the latest
            raise
        except BaseException:
            self.checkpoint_after_crash()
            raise
        finally:
            if self.source is not None:
                self.source.close()
            if launched is not None:
                launched.stop()
        return self.finish("completed")

    def open_source(self, model_path: Path, servers: ServerConfig | None) -> None:
        """The run's rollout source, in the state of the checkpoint the run (re)started from."""
        self.source = make_source(self.config, self.learner, self.tokenizer, self.task, model_path, self.backend,
                                  servers)
        if "source" in self.state:
            self.source.load_state(self.state["source"])
        if self.bound is not None:
            self.source.set_bound(self.bound.k)

    def launch_servers(self, model_path: Path):
        """The inference servers of ``rollout.server.launch``, started (not yet healthy), or None."""
        rc = self.config.rollout
        if rc.engine != "server" or rc.server.launch is None:
            return None
        from vcpo.rollout.launch import LaunchedServers

        return LaunchedServers(rc.server.launch, rc.server.kind, model_path, self.config.model.dtype,
                               self.run_dir / "server_logs", lora_rank=self.config.model.lora.rank).start()

    def loop(self, logger: MetricsLogger, bar: Progress) -> None:
        tc, learner = self.config.trainer, self.learner
        task_id = bar.add_task("train", total=tc.max_steps, completed=learner.version, info="")
        last = False
        while not last and learner.version < tc.max_steps:
            if self.signals.signum is not None:
                raise StopRequested
            t0 = time.perf_counter()
            with self.signals.interruptible():  # rollouts in progress are regenerated on resume
                trajectories = self.source.next_batch(learner.version)
            t_rollout = time.perf_counter() - t0
            metrics = batch_metrics(trajectories, learner.version)
            batch = Batch.from_trajectories(trajectories, pad_id=self.tokenizer.pad_token_id)
            metrics |= learner.step(batch)
            if self.bound is not None:  # the bound this batch was taken under, then the next step's from its ESS
                metrics["staleness/bound"] = float(self.bound.k)
                self.source.set_bound(self.bound.observe(metrics.get("ess/ratio")))
            self.source.publish(learner.model, learner.version)
            metrics |= self.source.metrics()
            self.health.record(metrics)
            step = learner.version
            elapsed_s = time.perf_counter() - self.started
            last = step == tc.max_steps or (tc.max_time_s is not None and elapsed_s >= tc.max_time_s)
            if last or (tc.eval_every and step % tc.eval_every == 0):
                t_eval = time.perf_counter()
                self.last_accuracy = self.evaluate()
                metrics |= self.eval_metrics
                metrics["time/eval_s"] = time.perf_counter() - t_eval
            if step == 1:
                metrics["eval/accuracy_initial"] = self.initial_accuracy
            metrics |= {"step": step, "time/rollout_wait_s": t_rollout, "time/step_s": time.perf_counter() - t0}
            alarms = self.monitor.observe(metrics, learner.skip_reason, final=last)
            metrics |= self.monitor.metrics
            append_trained_groups(self.run_dir, trained_group_records(trajectories, step))
            logger.log(metrics)
            self.logged_step = step
            for alarm in alarms:
                if not alarm.repeat:
                    say(alarm.line())
            for notice in self.monitor.notices:  # saturation: said, never acted on
                say(notice)
            bar.update(task_id, completed=step, info=(
                f"reward {metrics['reward/mean']:.2f}  ess {metrics['ess/ratio']:.2f}  "
                f"stale {metrics['staleness/max']:.0f}  acc {self.last_accuracy:.2f}"))
            if alarms and self.guarded:
                self.act(alarms)
            if self.health.consecutive_skipped >= tc.max_skipped_steps:
                hint = ", or use model.dtype=float32" if self.config.model.dtype == "bfloat16" else ""
                raise RunFailed(
                    f"{self.health.consecutive_skipped} consecutive steps skipped (trainer.max_skipped_steps="
                    f"{tc.max_skipped_steps}), the last for a {learner.skip_reason}: lower trainer.lr{hint}")
            if (self.guarded or (tc.checkpoint_every and step % tc.checkpoint_every == 0)) and not last:
                self.checkpoint()

    def act(self, alarms: list[Alarm]) -> None:
        """``trainer.on_alarm`` stop or rollback, after a step that raised ``alarms``: raises ``HealthAlarm`` (stop;
        rollback out of retries) or ``_Rollback``."""
        tc = self.config.trainer
        what = f"health alarm ({', '.join(a.rule for a in alarms)}) at step {alarms[0].step}"
        if tc.on_alarm == "stop":
            self.set_aside_after(min(a.last_good for a in alarms))
            raise HealthAlarm(f"{what} (trainer.on_alarm=stop)")
        if self.monitor.rollbacks >= tc.max_rollbacks:
            raise HealthAlarm(f"{what} after {self.monitor.rollbacks} rollbacks (trainer.max_rollbacks="
                              f"{tc.max_rollbacks})")
        raise _Rollback(alarms)

    def roll_back(self, alarms: list[Alarm]) -> None:
        """Back to the newest checkpoint no alarm suspects (step <= every alarm's ``last_good``), the later ones
        and their metrics lines discarded, with each rule's remedy applied (the learning rate halved); the alarm
        counts, rollbacks and learning-rate factor carry on. Raises ``HealthAlarm`` when no such checkpoint is left.
        The caller opens a new rollout source in the checkpoint's state (async workers start afresh)."""
        target = min(a.last_good for a in alarms)
        what = f"health alarm ({', '.join(a.rule for a in alarms)}) at step {alarms[0].step}"
        kept = [(step, path) for step, path in complete_checkpoints(self.run_dir) if step <= target]
        if not kept:
            raise HealthAlarm(f"{what}: no checkpoint at or before step {target} to roll back to")
        step, ckpt = kept[-1]
        self.source.close()
        self.source = None
        discard_after(self.run_dir, step)
        self.state = load_checkpoint(ckpt, self.learner.model, self.learner.optimizer)
        self.learner.version = self.saved_step = self.logged_step = step
        truncate_metrics(self.run_dir / METRICS_FILE, after_step=step)
        truncate_metrics(self.run_dir / TRAINED_GROUPS_FILE, after_step=step)
        self.last_accuracy = self.state.get("last_accuracy", self.initial_accuracy)
        self.health.consecutive_skipped = 0
        factor = min(REMEDIES[a.rule].lr_factor for a in alarms)
        before = self.learner.lr
        self.monitor.rolled_back(self.state.get("alarms"), factor)
        self.learner.lr = self.config.trainer.lr * self.monitor.lr_factor
        lowered = ""
        if self.bound is not None:  # async.max_staleness: auto: the checkpoint's bound, lowered once
            self.bound = adaptive_staleness(self.config.async_, self.state.get("staleness"))
            k_before = self.bound.k
            lowered = f"; staleness bound {k_before} -> {self.bound.lower()}"
        say(f"health: rolled back to step {step} ({ckpt.name}) after the {what}; learning rate {before:g} -> "
            f"{self.learner.lr:g}{lowered} (rollback {self.monitor.rollbacks} of at most "
            f"{self.config.trainer.max_rollbacks})")

    def checkpoint(self) -> None:
        """Save the last finished step, unless it is saved already, comes in a run of skipped steps (weights that
        have just produced non-finite values are not worth resuming from, the last good checkpoint is), or did
        not finish (an error after the update but before its metrics line: weights and metrics would disagree)."""
        version = self.learner.version
        if version == self.saved_step or version != self.logged_step or self.health.consecutive_skipped:
            return
        trainer_state = {
            "step": self.learner.version, "initial_accuracy": self.initial_accuracy,
            "last_accuracy": self.last_accuracy, "source": self.source.state(), "health": self.health.state(),
            "alarms": self.monitor.state(),
        } | ({"staleness": self.bound.state()} if self.bound is not None else {})
        try:
            save_checkpoint(self.run_dir, self.learner.version, self.learner.model, self.tokenizer,
                            self.learner.optimizer, trainer_state, keep=self.keep)
        except CheckpointError as e:  # non-finite weights: the previous checkpoint stays the latest
            raise RunFailed(str(e)) from None
        self.saved_step = self.learner.version

    def set_aside_suspect(self) -> None:
        """After a run of skipped steps, the checkpoint of the step just before it holds the weights that went on
        to fail (finite, yet producing NaN): set it aside so that a resume starts from the one before."""
        suspect = self.learner.version - self.health.consecutive_skipped
        if self.health.consecutive_skipped and self.saved_step == suspect > 0:
            self._set_aside(suspect)
            say(f"warning: set aside the checkpoint of step {suspect}, written just before the skipped steps")

    def set_aside_after(self, last_good: int) -> None:
        """A run an alarm stops keeps only checkpoints no alarm suspects (step <= ``last_good``): the later ones are
        set aside (``step_N.suspect``, never resumed from), so that ``latest`` names the last healthy one."""
        suspects = [step for step, _ in complete_checkpoints(self.run_dir) if step > last_good]
        for step in reversed(suspects):
            self._set_aside(step)
        if suspects:
            say(f"health: set aside the checkpoints of step{'s' if len(suspects) > 1 else ''} "
                f"{', '.join(map(str, suspects))}: the alarm suspects their weights")

    def _set_aside(self, step: int) -> None:
        """Step ``step``'s checkpoint set aside; the newest one left is the one a resume starts from."""
        kept = set_aside(self.run_dir, step)
        self.saved_step = int(kept.name.split("_")[1]) if kept is not None else 0

    def checkpoint_after_crash(self) -> None:
        """On an unexpected error, keep every finished step if possible, without hiding the error itself."""
        if self.source is None or self.learner.version == self.saved_step:
            return
        try:
            self.checkpoint()
            say(f"crashed after step {self.learner.version}: {self.kept()}")
        except Exception as e:
            say(f"crashed after step {self.learner.version}, and its checkpoint failed too: {e}")

    def kept(self) -> str:
        """Where a resume would start."""
        if self.saved_step == 0:
            return "no checkpoint to resume from"
        return f"the latest checkpoint is step {self.saved_step}; continue with --resume {self.run_dir}"

    def finish(self, status: str) -> dict[str, Any]:
        """Write summary.json (accuracy, status, and every count of what went wrong) and return it."""
        summary = {
            "run_dir": str(self.run_dir), "status": status, "steps": self.learner.version,
            "initial_accuracy": self.initial_accuracy, "final_accuracy": self.last_accuracy,
            "wall_time_s": time.perf_counter() - self.started, "objective": self.config.objective.name,
            "mode": self.config.async_.mode, "max_staleness": self.config.async_.max_staleness,
        } | accuracy_verdict(self.initial_accuracy, self.last_accuracy, len(self.eval_problems))
        summary |= self.health.counts(self.source.metrics() if self.source is not None else {}) | self.monitor.summary()
        if self.bound is not None:  # async.max_staleness: auto
            summary["staleness_bound"] = self.bound.k
        try:
            (self.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        except OSError as e:
            raise DiskError(self.run_dir / SUMMARY_FILE, e) from None
        return summary


class _Rollback(Exception):
    """``trainer.on_alarm: rollback``: leaves the loop (and its metrics file) for ``_Job.roll_back``."""

    def __init__(self, alarms: list[Alarm]) -> None:
        super().__init__(alarms[0].line())
        self.alarms = alarms
