"""Evaluation of a policy on held-out problems: greedy accuracy, and mean@k / pass@k over k samples per problem,
all through the rollout engine (one decode path for training and evaluation)."""

from __future__ import annotations

from dataclasses import dataclass
from math import comb
from typing import Any

import torch

from vcpo.envs.multiturn import is_multiturn
from vcpo.rollout.engine import HFRolloutEngine
from vcpo.rollout.episodes import run_episodes
from vcpo.tasks import Task, score_completions
from vcpo.tasks.prompts import encode_prompts
from vcpo.types import Problem, SamplingParams

EVAL_TEMPERATURE = 0.8  # the sampling settings reasoning papers report mean@k / pass@k at
EVAL_TOP_P = 0.7


@dataclass(frozen=True)
class EvalSettings:
    """How to evaluate: greedy decoding always; ``samples`` > 0 adds that many samples per problem at
    ``temperature`` / ``top_p`` (mean@samples, pass@samples)."""

    max_new_tokens: int
    samples: int = 0
    temperature: float = EVAL_TEMPERATURE
    top_p: float = EVAL_TOP_P
    seed: int = 0
    batch_size: int = 64
    lm_head_fp32: bool = False


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from ``n`` samples of which ``c`` are correct (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code", eq. 1): ``1 - C(n-c, k) / C(n, k)``, the chance that ``k`` of the ``n``
    samples drawn without replacement hold at least one correct one. With ``k = n`` it is 1 when ``c > 0``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def at_k_metrics(correct_P_N: list[list[bool]], k: int) -> dict[str, float]:
    """``mean@N`` (the mean correctness over all P x N samples, i.e. the expected accuracy of one sample) and
    ``pass@k`` (the unbiased estimate averaged over the P problems) of P problems with N samples each."""
    n = len(correct_P_N[0])
    mean = sum(sum(row) for row in correct_P_N) / (len(correct_P_N) * n)
    passed = sum(pass_at_k(n, sum(row), k) for row in correct_P_N) / len(correct_P_N)
    return {f"mean@{n}": mean, f"pass@{k}": passed}


@torch.no_grad()
def completions(model: Any, tokenizer: Any, problems: list[Problem], sampling: SamplingParams, greedy: bool,
                generator: torch.Generator | None = None, lm_head_fp32: bool = False) -> list[str]:
    """The decoded completion of each problem (cut at its first EOS), greedy or sampled with ``sampling``; prompts
    are tokenized by :func:`~vcpo.tasks.prompts.encode_prompts`, as in training (chat template included)."""
    engine = HFRolloutEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                             lm_head_fp32=lm_head_fp32)
    generations = engine.generate(encode_prompts(tokenizer, problems), sampling, greedy=greedy, generator=generator)
    return [tokenizer.decode(g.response_ids, skip_special_tokens=True) for g in generations]


def greedy_completions(model: Any, tokenizer: Any, problems: list[Problem], max_new_tokens: int,
                       lm_head_fp32: bool = False) -> list[str]:
    """Greedy completions of ``problems``."""
    return completions(model, tokenizer, problems, SamplingParams(max_new_tokens=max_new_tokens), True,
                       lm_head_fp32=lm_head_fp32)


@torch.no_grad()
def greedy_episodes(model: Any, tokenizer: Any, task: Any, problems: list[Problem], max_new_tokens: int,
                    lm_head_fp32: bool = False) -> list[Any]:
    """Greedy multi-turn episodes of ``problems`` (a ``MultiTurnEnv`` task), through the rollout engine."""
    engine = HFRolloutEngine(model, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                             lm_head_fp32=lm_head_fp32)
    prompt_ids = tokenizer([p.prompt for p in problems], add_special_tokens=False)["input_ids"]
    return run_episodes(engine, tokenizer, task, problems, prompt_ids, SamplingParams(max_new_tokens=max_new_tokens),
                        greedy=True)


def evaluate(
    model: Any, tokenizer: Any, task: Task, problems: list[Problem], settings: EvalSettings
) -> dict[str, float]:
    """``{"eval/accuracy": greedy accuracy}`` and, with ``settings.samples = N > 0``, ``eval/mean@N`` and
    ``eval/pass@N`` (:func:`at_k_metrics`). A completion counts as correct when its reward is exactly 1.0 (partial
    credit, which some reasoning-gym scorers give, does not). Sampling is seeded by ``settings.seed``. A multi-turn
    task is evaluated on greedy episodes only (``max_new_tokens`` per turn, scored by its environment); an agent task
    as its problem task (its agent runs in training rollouts only)."""
    from vcpo.agents.task import is_agent_task

    if is_agent_task(task):
        task = task.base
    if not problems:
        return {"eval/accuracy": 0.0}
    was_training = model.training
    model.eval()
    greedy_sampling = SamplingParams(max_new_tokens=settings.max_new_tokens)
    sampled = SamplingParams(settings.temperature, settings.top_p, settings.max_new_tokens)
    generator = torch.Generator().manual_seed(settings.seed)
    correct, rows = 0, []
    for i in range(0, len(problems), settings.batch_size):
        chunk = problems[i : i + settings.batch_size]
        if is_multiturn(task):
            correct += sum(e.reward == 1.0 for e in greedy_episodes(model, tokenizer, task, chunk,
                                                                   settings.max_new_tokens, settings.lm_head_fp32))
            continue
        texts = completions(model, tokenizer, chunk, greedy_sampling, True, lm_head_fp32=settings.lm_head_fp32)
        correct += sum(o.reward == 1.0 for o in score_completions(task, chunk, texts))
        if settings.samples:
            repeated = [p for p in chunk for _ in range(settings.samples)]
            texts = completions(model, tokenizer, repeated, sampled, False, generator, settings.lm_head_fp32)
            hits = [o.reward == 1.0 for o in score_completions(task, repeated, texts)]
            rows += [hits[j : j + settings.samples] for j in range(0, len(hits), settings.samples)]
    model.train(was_training)
    metrics = {"eval/accuracy": correct / len(problems)}
    if rows:
        metrics |= {f"eval/{key}": value for key, value in at_k_metrics(rows, settings.samples).items()}
    return metrics


def evaluate_accuracy(
    model: Any, tokenizer: Any, task: Task, problems: list[Problem], max_new_tokens: int, batch_size: int = 64,
    lm_head_fp32: bool = False,
) -> float:
    """Greedy accuracy: the fraction of ``problems`` whose greedy completion gets reward exactly 1.0
    (``lm_head_fp32``: the logits in float32, as in training with that option)."""
    settings = EvalSettings(max_new_tokens, batch_size=batch_size, lm_head_fp32=lm_head_fp32)
    return evaluate(model, tokenizer, task, problems, settings)["eval/accuracy"]
