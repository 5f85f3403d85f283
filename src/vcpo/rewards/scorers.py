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


def prepare(scorer: str, args: tuple) -> None:
    """Build what ``scorer`` needs from trusted arguments only (no completion), so that it is built once per
    worker rather than once per forked scoring process."""
    if scorer == "reasoning_gym":
        name, kwargs = args[0], args[1]
        key = _dataset_key(name, kwargs)
        if key not in _datasets:
            _datasets[key] = reasoning_gym.create_dataset(name, size=1, seed=0, **kwargs)


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


def quiet() -> None:
    """math-verify warns on every call made without its signal timeouts; that is deliberate here."""
    logging.disable(logging.WARNING)
