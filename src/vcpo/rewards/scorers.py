"""The scoring functions the reward pool's workers run, inside the sandbox and never in the trainer's process:
a reasoning-gym dataset's own ``score_answer`` (some ``eval`` the completion, others sympy ``parse_expr`` it) and
math-verify equivalence. Imported once per worker, so each scorer's libraries load once."""

from __future__ import annotations

import json
import logging
from typing import Any

import reasoning_gym
from math_verify import parse, verify

from vcpo.rewards.answers import extract_answer, reference_answer

_datasets: dict[str, Any] = {}


def _dataset_key(name: str, kwargs: dict[str, Any]) -> str:
    return json.dumps([name, kwargs], sort_keys=True, default=str)


def prepare(scorer: str, args: tuple) -> bool:
    """Build what ``scorer`` needs from trusted arguments only (no completion), so that it is built once per
    worker rather than once per forked scoring process; True when something new was built."""
    if scorer == "reasoning_gym":
        name, kwargs = args[0], args[1]
        key = _dataset_key(name, kwargs)
        if key not in _datasets:
            dataset = _datasets[key] = reasoning_gym.create_dataset(name, size=1, seed=0, **kwargs)
            entry = dataset[0]
            dataset.score_answer(entry["answer"], entry)  # lazy state built here is inherited by every fork
            return True
    return False


def score_reasoning_gym(completion: str, name: str, kwargs: dict[str, Any], entry: dict[str, Any]) -> float:
    """``score_answer`` of reasoning-gym dataset ``name`` on the whitespace-stripped completion."""
    return float(_datasets[_dataset_key(name, kwargs)].score_answer(completion.strip(), entry))


def score_math(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer (``extract_answer``) is equivalent to ``answer`` under math-verify.

    Both sides are wrapped in ``\\boxed{}`` so math-verify reads them as LaTeX; its own signal-based timeouts
    are off (``None``): the pool's parent enforces the deadline by killing the worker.
    """
    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    gold = parse(f"\\boxed{{{reference_answer(answer)}}}", parsing_timeout=None)
    guess = parse(f"\\boxed{{{predicted}}}", parsing_timeout=None)
    return 1.0 if gold and guess and verify(gold, guess, timeout_seconds=None) else 0.0


SCORERS = {"reasoning_gym": score_reasoning_gym, "math": score_math}


def warm_up() -> None:
    """Silence math-verify's warning about its disabled signal timeouts (deliberate here) and build its lazy
    state (parsers, caches) once in the worker, so that the forked scoring processes inherit it."""
    logging.disable(logging.WARNING)
    for completion, answer in ((r"\boxed{\frac{1}{2}}", "0.5"), ("#### 1,000", "1000"), (r"\boxed{x = 3}", "3"),
                               (r"\boxed{\{1, 2\}}", r"\{2,1\}"), (r"\boxed{(0, 1]}", "(0,1]")):
        score_math(completion, answer)
