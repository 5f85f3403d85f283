"""``math_reward`` (API.md §6): is a completion's final answer equivalent to the reference, by math-verify?

Extraction and comparison both run in the sandboxed scoring pool (sympy's parser ``eval``s, and some inputs make
it hang): the caller's process only truncates the text and waits, at most ``timeout_s`` per answer.
"""

from __future__ import annotations

import warnings

from vcpo.rewards.pool import RewardOutcome, ScoreRequest, shared_pool


def math_rewards(completions: list[str], answers: list[str], timeout_s: float = 5.0) -> list[RewardOutcome]:
    """:func:`math_reward` of many pairs in one batch (one round trip per worker); outcomes say why a 0 is 0.

    Raises ``ValueError`` when the lists differ in length or ``timeout_s`` is not positive.
    """
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    requests = [ScoreRequest("math", (str(a),), str(c)) for c, a in zip(completions, answers, strict=True)]
    return shared_pool().score(requests, timeout_s)


def math_reward(completion: str, answer: str, timeout_s: float = 5.0) -> float:
    """1.0 when the final answer of ``completion`` equals ``answer`` up to mathematical equivalence, else 0.0.

    The final answer is the last ``\\boxed{...}`` (balanced braces), else the text after the last ``####``,
    else the last number (``1,000`` and ``-3.5`` and ``3/4`` included); ``answer`` may itself be a bare value,
    a ``\\boxed{}`` solution or a GSM8K ``#### x`` field. Equivalence is math-verify's (``\\frac{1}{2}`` = 0.5,
    ``x = 3`` = 3, sets in any order, intervals, units and text ignored). Never raises: an error, a crash or a
    hang past ``timeout_s`` (the worker is killed) scores 0.0 and is counted in the pool's ``counts()``.
    Safe from any thread and from many at once.
    """
    try:
        return math_rewards([completion], [answer], timeout_s)[0].reward
    except Exception as exc:  # the contract: never raise; say why once per kind of failure
        warnings.warn(f"math_reward scored 0.0 because of {exc.__class__.__name__}: {exc}", RuntimeWarning,
                      stacklevel=2)
        return 0.0
