"""The task interface the trainer sees: deterministic problem streams and a reward in [0, 1]."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from vcpo.errors import UserError
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
    prompt, up to EOS) with a float in [0, 1]; 1.0 means fully correct.
    """

    name: str

    def problems(self, split: str, n: int, seed: int) -> list[Problem]: ...

    def reward(self, problem: Problem, completion: str) -> float: ...
