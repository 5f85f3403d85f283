"""Tasks: where problems and rewards come from (reasoning-gym generators and local dataset files behind a small
``Task`` Protocol). Imported lazily: naming a name here loads only the module that defines it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vcpo.config import TaskConfig
    from vcpo.tasks.base import Task

_EXPORTS = {
    "SPLITS": "vcpo.tasks.base", "Task": "vcpo.tasks.base", "TaskError": "vcpo.tasks.base",
    "prepare_scoring": "vcpo.tasks.base", "score_completions": "vcpo.tasks.base",
    "ReasoningGymTask": "vcpo.tasks.reasoning_gym_task", "DatasetTask": "vcpo.tasks.dataset_task",
    "PromptFormat": "vcpo.tasks.prompts", "encode_prompts": "vcpo.tasks.prompts",
    "ToolTask": "vcpo.tasks.tool_task", "TOOL_PREFIX": "vcpo.tasks.tool_task",
}


def make_task(config: TaskConfig) -> Task:
    """The task a config names: a :class:`DatasetTask` for ``jsonl`` / ``parquet``, the multi-turn :class:`ToolTask`
    for ``tools:<dataset>``, an :class:`~vcpo.agents.task.AgentTask` for ``agent:<module>:<function>``, a user's
    own task for an import path (``module.sub:Name(**config.kwargs)``), else
    ``ReasoningGymTask(config.name, **config.kwargs)``; with the config's prompt format and reward (vcpo's
    single-turn tasks), reward deadline and scoring workers. Bad settings raise TaskError (one line)."""
    from vcpo.tasks.prompts import PromptFormat
    from vcpo.tasks.records import DATASET_TASKS
    from vcpo.tasks.tool_task import TOOL_PREFIX, ToolTask
    from vcpo.tasks.user_task import is_user_task, make_user_task

    if config.name.startswith("agent:"):
        from vcpo.agents.task import AgentTask

        return AgentTask(config)
    if is_user_task(config.name):
        return make_user_task(config.name, config.kwargs)
    if config.name.startswith(TOOL_PREFIX):
        return ToolTask(config.name, reward_timeout_s=config.reward_timeout_s, reward_workers=config.reward_workers,
                        **config.kwargs)

    prompt_format = PromptFormat(config.prompt_format, config.system_prompt, config.instruction)
    common = {"prompt_format": prompt_format, "reward": config.reward, "reward_timeout_s": config.reward_timeout_s,
              "reward_workers": config.reward_workers}
    if config.name in DATASET_TASKS:
        from vcpo.tasks.dataset_task import DatasetTask

        return DatasetTask(config.name, **common, **config.kwargs)
    from vcpo.tasks.reasoning_gym_task import ReasoningGymTask

    return ReasoningGymTask(config.name, **common, **config.kwargs)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'vcpo.tasks' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = [*_EXPORTS, "make_task"]
