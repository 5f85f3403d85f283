"""Tasks: where problems and rewards come from (reasoning-gym datasets behind a small ``Task`` Protocol)."""

from __future__ import annotations

from vcpo.config import TaskConfig
from vcpo.tasks.base import SPLITS, Task, TaskError, prepare_scoring, score_completions
from vcpo.tasks.reasoning_gym_task import ReasoningGymTask
from vcpo.tasks.tool_task import TOOL_PREFIX, ToolTask


def make_task(config: TaskConfig) -> Task:
    """The task a config names: ``ReasoningGymTask(config.name, **config.kwargs)`` with the config's reward
    deadline and scoring workers (``tools:<dataset>``: the multi-turn :class:`ToolTask`); bad settings raise
    TaskError."""
    if config.name.startswith(TOOL_PREFIX):
        return ToolTask(config.name, reward_timeout_s=config.reward_timeout_s, reward_workers=config.reward_workers,
                        **config.kwargs)
    return ReasoningGymTask(config.name, reward_timeout_s=config.reward_timeout_s,
                            reward_workers=config.reward_workers, **config.kwargs)


__all__ = ["SPLITS", "ReasoningGymTask", "Task", "TaskError", "ToolTask", "make_task", "prepare_scoring",
           "score_completions"]
