"""Three losses inside TRL's asynchronous GRPO trainer, side by side (issue 44, item 2): TRL's own PPO-clip loss,
VCPO (sequence TIS cap 8, OPOB ``grad_only`` with the logit proxy, ESS learning rate) and VESPO (GRPO advantages),
each at a small and a large ``max_staleness``, over seeds, with the same model, task, rollout worker and budget.
Beside them, ``vcpo_native``: the same VCPO configuration trained by vcpo's own asynchronous trainer (``vcpo train``
with ``async.mode: async``, its own rollout worker and staleness bound ``async.max_staleness``), on the same model,
problems, batch, learning rate and step budget, scored by the same held-out check.

The work is vcpo's quickstart: the embedded tiny Llama warm-started by SFT on two-term ``chain_sum`` (cached by
``configs/quickstart.yaml``'s ``sft``), ``LocalRolloutWorker`` generating in a thread beside TRL's training loop.
The reward is an exact match of the stripped completion with the answer (what the task's scorer gives on these
sums); held-out accuracy is greedy, on ``--eval-size`` problems of the task's eval split, before and after.
Each run appends one JSON line to ``OUT/runs.jsonl``; the summary (mean and 95% t-interval over seeds) is printed
and written to ``OUT/summary.md``.

    python benchmarks/trl_async_side_by_side.py --steps 60 --seeds 0 1 2 3 --staleness 2 16 --out runs/trl_async_sbs
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

from vcpo.config import load_config
from vcpo.integrations.trl import LocalRolloutWorker, LocalWeightTransfer, VCPOAsyncGRPOTrainer
from vcpo.integrations.trl_local import unknown_peak_flops_without_cuda, use_reference_tree_attention
from vcpo.rollout.engine import HFRolloutEngine
from vcpo.study.stats import paired_difference, t_interval
from vcpo.tasks import make_task
from vcpo.train.sft import warm_start
from vcpo.types import SamplingParams

ARMS: dict[str, dict[str, Any]] = {
    "trl": {},  # TRL's own loss on the worker's GRPO advantages
    "vcpo": {"objective": "vcpo", "advantage_estimator": "opob", "opob_variant": "grad_only",
             "grad_norm_method": "logit_proxy", "ess_lr_rule": "sqrt"},
    "vespo": {"objective": "vespo", "advantage_estimator": "trl", "ess_lr_rule": None},
    "vcpo_native": {},  # the vcpo arm's configuration in vcpo's own async trainer (native_overrides)
}


class CPUAsyncGRPOTrainer(AsyncGRPOTrainer):
    """TRL's own AsyncGRPOTrainer, unchanged but for the two CPU stand-ins ``VCPOAsyncGRPOTrainer`` also uses."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with unknown_peak_flops_without_cuda():
            super().__init__(*args, **kwargs)
        use_reference_tree_attention()


class ExactAnswer:
    """Reward 1.0 when the stripped completion is the problem's answer (``answer`` column), else 0.0."""

    __name__ = "exact_answer"

    def __call__(self, completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [float(c.strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]


def greedy_accuracy(model: torch.nn.Module, tokenizer: Any, problems: list[Any], max_new_tokens: int) -> float:
    """Share of ``problems`` whose greedy completion is exactly the answer."""
    engine = HFRolloutEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    gens = engine.generate([tokenizer(p.prompt)["input_ids"] for p in problems],
                           SamplingParams(max_new_tokens=max_new_tokens), greedy=True)
    completions = [tokenizer.decode(g.response_ids, skip_special_tokens=True) for g in gens]
    return sum(ExactAnswer()(completions, [p.answer for p in problems])) / len(problems)


def native_overrides(staleness: int, seed: int, model_dir: Path, run_dir: Path,
                     args: argparse.Namespace) -> list[str]:
    """``vcpo train`` overrides of configs/quickstart.yaml giving the ``vcpo`` arm's configuration (sequence TIS cap
    8, OPOB ``grad_only`` with the logit proxy, ESS learning rate by the sqrt rule, reference 1) and the side by
    side's budget, in vcpo's own asynchronous trainer with staleness bound ``staleness``."""
    return [f"seed={seed}", f"run_dir={run_dir}", f"model.path={model_dir}", "objective.name=vcpo",
            "advantage.estimator=opob", "advantage.opob_variant=grad_only", "advantage.grad_norm_method=logit_proxy",
            "trainer.ess_lr.enabled=true", "trainer.ess_lr.rule=sqrt", "trainer.ess_lr.reference=1.0",
            f"trainer.lr={args.lr}", f"trainer.max_steps={args.steps}", "trainer.eval_every=0",
            f"trainer.checkpoint_every={args.steps}", f"rollout.prompts_per_step={args.groups_per_step}",
            f"rollout.group_size={args.group_size}", f"rollout.max_new_tokens={args.max_new_tokens}",
            "async.mode=async", f"async.max_staleness={staleness}", "logging.progress=false"]


def run_native(staleness: int, seed: int, model_dir: Path, eval_problems: list[Any],
               args: argparse.Namespace) -> dict[str, Any]:
    """One run of vcpo's own asynchronous trainer with the ``vcpo`` arm's configuration; the same row as ``run``."""
    from vcpo.loop.trainer import train as vcpo_train
    from vcpo.metrics import METRICS_FILE, read_metrics
    from vcpo.train.checkpoint import load_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as out:
        config = load_config("configs/quickstart.yaml", native_overrides(staleness, seed, model_dir, Path(out), args))
        start = time.perf_counter()
        vcpo_train(config)
        seconds = time.perf_counter() - start
        steps = [m for m in read_metrics(Path(out) / METRICS_FILE) if "ess/ratio" in m]
        policy = AutoModelForCausalLM.from_pretrained(model_dir)
        load_checkpoint(Path(out) / "checkpoints" / f"step_{args.steps:06d}", policy)
    return {
        "arm": "vcpo_native", "max_staleness": staleness, "seed": seed, "steps": len(steps),
        "accuracy": greedy_accuracy(policy, tokenizer, eval_problems, args.max_new_tokens),
        "seconds_per_step": seconds / max(len(steps), 1),  # includes vcpo's start (workers, the first eval)
        "staleness_mean": statistics.fmean(m.get("staleness/mean", 0.0) for m in steps),
        "staleness_max": max(m.get("staleness/max", 0.0) for m in steps),
        # groups dropped over the bound, a running count, in samples as TRL counts them
        "dropped_stale": steps[-1].get("staleness/dropped_over_bound", 0.0) * args.group_size,
        "ess_ratio_mean": statistics.fmean(m["ess/ratio"] for m in steps),
        "train_reward_last10": statistics.fmean(m.get("reward/mean", math.nan) for m in steps[-10:]),
    }


def run(arm: str, staleness: int, seed: int, model_dir: Path, train: Dataset, eval_problems: list[Any],
        args: argparse.Namespace) -> dict[str, Any]:
    """One training run of ``arm``; its held-out accuracy before and after, seconds per step and batch stats."""
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples_per_step = args.groups_per_step * args.group_size
    worker = LocalRolloutWorker(str(model_dir), tokenizer, train.shuffle(seed=seed), ExactAnswer(),
                                num_generations=args.group_size, max_completion_length=args.max_new_tokens,
                                queue_maxsize=(staleness + 1) * samples_per_step,
                                prompts_per_batch=args.prompts_per_batch, seed=seed)
    with tempfile.TemporaryDirectory() as out:
        config = AsyncGRPOConfig(output_dir=out, use_cpu=True, bf16=False, gradient_checkpointing=False,
                                 report_to="none", per_device_train_batch_size=samples_per_step,
                                 num_generations=args.group_size, max_completion_length=args.max_new_tokens,
                                 max_steps=args.steps, learning_rate=args.lr, logging_steps=1, save_strategy="no",
                                 seed=seed, disable_tqdm=True, token_budget=0, max_staleness=staleness)
        common = {"model": str(model_dir), "reward_funcs": ExactAnswer(), "args": config, "train_dataset": train,
                  "processing_class": tokenizer, "rollout_worker": worker}
        try:
            if arm == "trl":
                trainer = CPUAsyncGRPOTrainer(**common, weight_transfer=LocalWeightTransfer(worker))
            else:
                trainer = VCPOAsyncGRPOTrainer(**common, **ARMS[arm])
            start = time.perf_counter()
            trainer.train()
            seconds = time.perf_counter() - start
        finally:
            worker.stop()
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    policy.load_state_dict(trainer.accelerator.unwrap_model(trainer.model).state_dict())
    logs = [line for line in trainer.state.log_history if "loss" in line]
    return {
        "arm": arm, "max_staleness": staleness, "seed": seed, "steps": len(logs),
        "accuracy": greedy_accuracy(policy, tokenizer, eval_problems, args.max_new_tokens),
        "seconds_per_step": seconds / max(len(logs), 1),
        "staleness_mean": statistics.fmean(line.get("sample/staleness_mean", 0.0) for line in logs),
        "staleness_max": max(line.get("sample/staleness_max", 0.0) for line in logs),
        "dropped_stale": sum(line.get("sample/dropped_stale_total", 0.0) for line in logs),
        "ess_ratio_mean": statistics.fmean(line["ess/ratio"] for line in logs) if "ess/ratio" in logs[0] else None,
        "train_reward_last10": statistics.fmean(line.get("reward", math.nan) for line in logs[-10:]),
    }


def summary(rows: list[dict[str, Any]], before: float) -> str:
    """The table: per arm and staleness bound, accuracy after (mean [95% t-interval] over seeds), its paired
    difference to TRL's own loss on the same seeds, seconds per step and the staleness the runs saw."""
    lines = [f"held-out greedy accuracy before RL: {before:.3f}", "",
             "| arm | max_staleness | runs | accuracy after | minus trl (paired) | s / step | staleness mean (max) "
             "| dropped stale |", "|---|---|---|---|---|---|---|---|"]
    for k in sorted({r["max_staleness"] for r in rows}):
        accuracy = {arm: {r["seed"]: r["accuracy"] for r in rows if r["arm"] == arm and r["max_staleness"] == k}
                    for arm in ARMS}
        for arm in ARMS:
            cell = [r for r in rows if r["arm"] == arm and r["max_staleness"] == k]
            if not cell:
                continue
            difference = paired_difference(accuracy[arm], accuracy["trl"]) if arm != "trl" else None
            lines.append(
                f"| {arm} | {k} | {len(cell)} | {t_interval([r['accuracy'] for r in cell])} | "
                f"{difference if difference is not None else ''} | "
                f"{statistics.fmean(r['seconds_per_step'] for r in cell):.2f} | "
                f"{statistics.fmean(r['staleness_mean'] for r in cell):.2f} "
                f"({max(r['staleness_max'] for r in cell):.0f}) | "
                f"{statistics.fmean(r['dropped_stale'] for r in cell):.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--staleness", type=int, nargs="+", default=[2, 16])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--groups-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-batch", type=int, default=64,
                        help="prompts the worker samples at once: enough to keep it ahead of every arm's trainer")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("runs/trl_async_sbs"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = load_config("configs/quickstart.yaml")
    model_dir = warm_start(config)
    task = make_task(config.task)
    train_problems = task.problems("train", 512, seed=0)
    eval_problems = task.problems("eval", args.eval_size, seed=0)
    train = Dataset.from_dict({"prompt": [p.prompt for p in train_problems],
                               "answer": [p.answer for p in train_problems]})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    before = greedy_accuracy(AutoModelForCausalLM.from_pretrained(model_dir), tokenizer, eval_problems,
                             args.max_new_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        for staleness in args.staleness:
            for arm in args.arms:
                row = (run_native(staleness, seed, model_dir, eval_problems, args) if arm == "vcpo_native"
                       else run(arm, staleness, seed, model_dir, train, eval_problems, args))
                rows.append(row)
                with open(args.out / "runs.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
    text = summary(rows, before)
    (args.out / "summary.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
