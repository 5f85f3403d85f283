"""The task interface the trainer sees: deterministic problem streams and a reward in [0, 1]."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from vcpo.errors import UserError
from vcpo.rewards.pool import RewardOutcome
from vcpo.types import Problem

SPLITS = ("train", "eval")


class TaskError(UserError, ValueError):
    """A user-fixable problem with the task settings; its message is one line naming the culprit."""


@runtime_checkable
class Task(Protocol):
    """A source of problems and their scorer.

    ``problems(split, n, seed)`` returns the same ``n`` problems for the same arguments; the "train"
    and "eval" splits never draw from the same generator seed, so held-out accuracy is held out.
    ``reward(problem, completion)`` scores the model's completion (the text it generated after the
    prompt, up to EOS) with a float in [0, 1]; 1.0 means fully correct. vcpo's tasks score in the sandboxed
    pool (:mod:`vcpo.rewards.pool`), never in the caller's process, and also offer ``score(problems,
    completions)``: a whole batch in one round trip, each reward with its status (see ``score_completions``).
    """

    name: str

    def problems(self, split: str, n: int, seed: int) -> list[Problem]: ...

    def reward(self, problem: Problem, completion: str) -> float: ...


def prepare_scoring(task: Task) -> None:
    """Let a task start its scorer in the background if it can (vcpo's tasks start their sandboxed workers and
    import the scorer's libraries there, seconds of CPU); call it early, before loading a model."""
    warm_up = getattr(task, "warm_up", None)
    if warm_up is not None:
        warm_up()


def score_completions(task: Task, problems: list[Problem], completions: list[str]) -> list[RewardOutcome]:
    """Rewards of a batch with their statuses: ``task.score`` when the task has it (one sandboxed round trip),
    else ``task.reward`` one by one (a task of the user's own, trusted to run here; if it raises: 0, ``error``)."""
    batch_score = getattr(task, "score", None)
    if batch_score is not None:
        return batch_score(problems, completions)
    outcomes = []
    for problem, completion in zip(problems, completions, strict=True):
        try:
            outcomes.append(RewardOutcome(float(task.reward(problem, completion))))
        except Exception:
            outcomes.append(RewardOutcome(0.0, "error"))
    return outcomes
