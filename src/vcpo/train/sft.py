"""Supervised warm start of the embedded default model (``vcpo sft``), cached by its settings.

RL from a random model would see no reward at all; a short teacher-forced fine-tune on solved training
problems brings the default policy to partial accuracy, leaving room for RL to improve it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from vcpo.config import Config
from vcpo.envs.multiturn import is_multiturn
from vcpo.models import default as default_model
from vcpo.models.loading import load_policy
from vcpo.runtime import resolve_device
from vcpo.tasks import Task, make_task
from vcpo.tasks.prompts import encode_prompts
from vcpo.train.evaluate import evaluate_accuracy
from vcpo.types import Problem

FORMAT_VERSION = 1  # bump when the model, tokenizer, prompt format or training recipe changes
IGNORE_INDEX = -100  # label of prompt and padding positions: no loss there
SUMMARY_FILE = "sft.json"

console = Console()


def sft_seed(config: Config) -> int:
    """The seed of the warm start: ``sft.seed``, or the run's ``seed`` when that is unset."""
    return config.seed if config.sft.seed is None else config.sft.seed


def cache_key(config: Config) -> str:
    """A short hash of everything that determines the warm-started model."""
    arch = config.sft.architecture
    determinants = {
        "format": FORMAT_VERSION,
        "task": config.task.name,
        "task_kwargs": config.task.kwargs,
        "steps": config.sft.steps,
        "batch_size": config.sft.batch_size,
        "lr": config.sft.lr,
        "seed": sft_seed(config),
        "architecture": [arch.hidden_size, arch.num_layers, arch.num_heads, arch.intermediate_size],
    }
    if config.task.instruction:  # it changes the raw prompts trained on; unset keeps every older key unchanged
        determinants["instruction"] = config.task.instruction
    blob = json.dumps(determinants, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def warm_start(config: Config) -> Path:
    """The model directory RL starts from.

    ``model.path`` when set (returned unchanged); otherwise the default model, fine-tuned for
    ``sft.steps`` steps and cached in ``{sft.cache_dir}/{task}-{cache_key}`` (an agent task's: its problem task's,
    the same entry). A cached directory is reused as is; a new one is written to a temporary directory and renamed
    into place, so an interrupted run never leaves a half-written cache entry.
    """
    if config.model.path is not None:
        return Path(config.model.path)
    if config.task.name.startswith("agent:"):  # warm-started on its problem task: the very model that task's runs use
        from vcpo.agents.task import problem_task_config

        config = config.model_copy(update={"task": problem_task_config(config.task)})
    cache_dir = Path(config.sft.cache_dir)
    final = cache_dir / f"{config.task.name}-{cache_key(config)}"
    say = console.print if config.logging.progress else (lambda *_: None)
    if (final / "config.json").is_file():
        say(f"[green]sft[/green] reusing warm-started model {final}")
        return final
    task = make_task(config.task)
    sc = config.sft
    say(f"[green]sft[/green] warm start (first run with these settings only): building the embedded default model and "
        f"fine-tuning it on {config.task.name}, {sc.steps} steps of {sc.batch_size} problems, then a greedy check on "
        f"{config.task.eval_size} held-out problems; cached in {final}. Each step's time and the time left follow.")
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{final.name}-tmp-"))
    try:
        summary = _build_and_train(config, task, tmp, say)
        (tmp / SUMMARY_FILE).write_text(json.dumps({"key": final.name, **summary}, indent=2))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache entry should read like any directory
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished the same entry first; theirs is equally valid
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"[green]sft[/green] saved warm-started model to {final}")
    return final


def _build_and_train(config: Config, task: Task, out_dir: Path, say: Any) -> dict[str, Any]:
    """Build the default model in ``out_dir``, fine-tune and save it there; returns a summary for ``sft.json``."""
    seed = sft_seed(config)
    default_model.build_default_model(task, seed, out_dir, config.sft.architecture)
    model, tokenizer = load_policy(out_dir, device=resolve_device(config.model.device))
    start = time.perf_counter()
    problems = task.problems("train", config.sft.steps * config.sft.batch_size, seed)
    demonstration = task.demonstration if is_multiturn(task) else None
    losses = train_sft(model, tokenizer, problems, config.sft.steps, config.sft.batch_size, config.sft.lr, say,
                       demonstration=demonstration)
    train_s = time.perf_counter() - start
    eval_problems = task.problems("eval", config.task.eval_size, seed)
    say(f"[green]sft[/green] trained in {train_s:.1f}s; checking greedy accuracy on {len(eval_problems)} held-out "
        f"problems")
    start = time.perf_counter()
    accuracy = evaluate_accuracy(model, tokenizer, task, eval_problems, config.rollout.max_new_tokens)
    say(f"[green]sft[/green] greedy accuracy {accuracy:.3f} on {len(eval_problems)} eval problems "
        f"({time.perf_counter() - start:.1f}s)")
    model.save_pretrained(out_dir, safe_serialization=True)
    # The recipe, so a pinned copy of this directory says what built it (and `vcpo sweep` can check the task).
    return {"eval_accuracy": accuracy, "eval_size": len(eval_problems), "train_s": round(train_s, 2),
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            **config.sft.model_dump(exclude={"cache_dir"}), "seed": seed,
            "task": {"name": config.task.name, "kwargs": config.task.kwargs}}


def train_sft(
    model: Any,
    tokenizer: Any,
    problems: list[Problem],
    steps: int,
    batch_size: int,
    lr: float,
    say: Any = console.print,
    demonstration: Any = None,
) -> list[float]:
    """Teacher-forced fine-tuning on ``prompt + answer + EOS``, loss on the answer and EOS tokens only; with
    ``demonstration`` (a multi-turn task's, see ``MultiTurnEnv.demonstration``) on its solved episodes instead,
    loss on the model's turns (each followed by EOS) only, never on the environment's observations.

    Step ``s`` uses ``problems[s*batch_size:(s+1)*batch_size]``; AdamW, learning rate warmed up linearly
    over the first 5% of steps, then constant. Constant rather than annealed on purpose: annealing to
    zero settles the model into a sharp minimum where every RL step hurts (measured on the default model:
    one policy-gradient step of L2 norm 0.03 cut greedy accuracy from 0.30 to 0.22 after cosine SFT).
    Returns the loss of every step. Runs on the model's device.
    """
    device = next(model.parameters()).device
    warmup = max(1, steps // 20)

    def schedule(step: int) -> float:
        return min(1.0, (step + 1) / warmup)

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    losses: list[float] = []
    report_every = max(1, steps // 10)
    start = time.perf_counter()
    for step in range(steps):
        chunk = problems[step * batch_size : (step + 1) * batch_size]
        input_ids_BS, attention_mask_BS, labels_BS = (
            t.to(device) for t in _teacher_forcing_batch(tokenizer, chunk, demonstration))
        loss = model(input_ids=input_ids_BS, attention_mask=attention_mask_BS, labels=labels_BS).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if (step + 1) % report_every == 0 or step + 1 == steps:
            elapsed_s = time.perf_counter() - start
            left_s = elapsed_s / (step + 1) * (steps - step - 1)
            say(f"sft step {step + 1}/{steps}  loss {losses[-1]:.4f}  {elapsed_s:.1f}s"
                + (f", about {left_s:.0f}s left" if step + 1 < steps else ""))
    model.eval()
    return losses


def _model_segments(problem: Problem, demonstration: Any) -> list[tuple[str, bool]]:
    """The text segments after the prompt of one example, each marked True when the model writes it (then EOS)."""
    return demonstration(problem) if demonstration else [(problem.answer, True)]


def _teacher_forcing_batch(tokenizer: Any, problems: list[Problem], demonstration: Any = None
                           ) -> tuple[torch.Tensor, ...]:
    """Right-padded example ids (the prompt as training tokenizes it, then the answer + EOS or a demonstration's
    segments), their attention mask, and labels masked to the model's own segments and their EOS."""
    rows, label_rows = [], []
    for problem, prompt_ids in zip(problems, encode_prompts(tokenizer, problems), strict=True):
        row, labels = list(prompt_ids), [IGNORE_INDEX] * len(prompt_ids)
        for text, by_model in _model_segments(problem, demonstration):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if by_model:
                ids = [*ids, tokenizer.eos_token_id]
            row += ids
            labels += ids if by_model else [IGNORE_INDEX] * len(ids)
        rows.append(row)
        label_rows.append(labels)
    S = max(len(r) for r in rows)
    input_ids_BS = torch.full((len(rows), S), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask_BS = torch.zeros((len(rows), S), dtype=torch.long)
    labels_BS = torch.full((len(rows), S), IGNORE_INDEX, dtype=torch.long)
    for b, (row, labels) in enumerate(zip(rows, label_rows, strict=True)):
        input_ids_BS[b, : len(row)] = torch.tensor(row)
        attention_mask_BS[b, : len(row)] = 1
        labels_BS[b, : len(row)] = torch.tensor(labels)
    return input_ids_BS, attention_mask_BS, labels_BS
