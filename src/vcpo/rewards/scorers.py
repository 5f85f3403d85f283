"""The scoring functions the reward pool's workers run, inside the sandbox and never in the trainer's process:
a reasoning-gym dataset's own ``score_answer`` (some ``eval`` the completion, others sympy ``parse_expr`` it),
math-verify equivalence, and a user's own reward function named by import path (``task.reward: module:fn``).

Each scorer has a *setup* (trusted arguments, never a completion: a dataset's name and settings) that
:func:`prepare` builds once per worker, importing the scorer's libraries on first use, so that a worker loads
only what its tasks need and every forked scoring process inherits it warm.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

from vcpo.rewards.answers import extract_answer, reference_answer
from vcpo.rewards.protocol import setup_key

REWARD_ARGUMENTS = ("completion", "answer")
"""What a user's reward function is called with: ``fn(completion, answer) -> float`` in [0, 1]."""
_built: dict[str, Any] = {}  # what prepare() built, by scorer and setup
_libraries: dict[str, ModuleType] = {}


def prepare(scorer: str, setup: tuple) -> bool:
    """Build ``scorer``'s setup if this worker has not yet; True when something new was built.

    Raises ``KeyError`` for an unknown scorer and whatever the library raises for a bad setup.
    """
    key = setup_key(scorer, setup)
    if key in _built:
        return False
    _built[key] = _PREPARERS[scorer](*setup)
    return True


def _prepare_reasoning_gym(name: str, kwargs: dict[str, Any]) -> Any:
    if "reasoning_gym" not in _libraries:
        import reasoning_gym

        _libraries["reasoning_gym"] = reasoning_gym
    dataset = _libraries["reasoning_gym"].create_dataset(name, size=1, seed=0, **kwargs)
    entry = dataset[0]
    dataset.score_answer(entry["answer"], entry)  # lazy state built here is inherited by every fork
    return dataset


def _prepare_math() -> None:
    """Import math-verify, silence its warning about the signal timeouts we turn off (the pool's parent keeps
    the deadline), and build its parsers once by scoring a few known pairs."""
    import math_verify

    _libraries["math_verify"] = math_verify
    logging.disable(logging.WARNING)
    for completion, answer in ((r"\boxed{\frac{1}{2}}", "0.5"), ("#### 1,000", "1000"), (r"\boxed{x = 3}", "3"),
                               (r"\boxed{\{1, 2\}}", r"\{2,1\}"), (r"\boxed{(0, 1]}", "(0,1]")):
        score_math(completion, answer)


def _prepare_user(path: str) -> Any:
    """Import a user's reward function (from the trainer's ``sys.path``, which the worker was started with)."""
    from vcpo.plugins import load_function

    return load_function(path, REWARD_ARGUMENTS)


def score_user(completion: str, path: str, answer: str) -> float:
    """A user's reward function ``path`` of the completion and the reference answer."""
    return float(_built[setup_key("user", (path,))](completion, answer))


def score_reasoning_gym(completion: str, name: str, kwargs: dict[str, Any], entry: dict[str, Any]) -> float:
    """``score_answer`` of reasoning-gym dataset ``name`` on the whitespace-stripped completion."""
    return float(_built[setup_key("reasoning_gym", (name, kwargs))].score_answer(completion.strip(), entry))


def score_math(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer (``extract_answer``) is equivalent to ``answer`` under math-verify.

    Both sides are wrapped in ``\\boxed{}`` so math-verify reads them as LaTeX; its own signal-based timeouts
    are off (``None``): the pool's parent enforces the deadline by killing the worker.
    """
    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    mv = _libraries["math_verify"]
    gold = mv.parse(f"\\boxed{{{reference_answer(answer)}}}", parsing_timeout=None)
    guess = mv.parse(f"\\boxed{{{predicted}}}", parsing_timeout=None)
    return 1.0 if gold and guess and mv.verify(gold, guess, timeout_seconds=None) else 0.0


_PREPARERS = {"reasoning_gym": _prepare_reasoning_gym, "math": _prepare_math, "user": _prepare_user}
SCORERS = {"reasoning_gym": score_reasoning_gym, "math": score_math, "user": score_user}
