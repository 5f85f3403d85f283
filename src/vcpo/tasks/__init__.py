"""Tasks: where problems and rewards come from (reasoning-gym datasets behind a small ``Task`` Protocol)."""

from __future__ import annotations

from vcpo.config import TaskConfig
from vcpo.tasks.base import SPLITS, Task, TaskError
from vcpo.tasks.reasoning_gym_task import ReasoningGymTask


def make_task(config: TaskConfig) -> Task:
    """The task a config names: ``ReasoningGymTask(config.name, **config.kwargs)``; bad settings raise TaskError."""
    return ReasoningGymTask(config.name, **config.kwargs)


__all__ = ["SPLITS", "ReasoningGymTask", "Task", "TaskError", "make_task"]
