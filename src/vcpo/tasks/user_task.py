"""A user's own task or multi-turn environment named by import path (``task.name: mypkg.envs:MyEnv``): a class or
factory, checked when the config loads and called with ``task.kwargs`` wherever the task is built (the trainer,
each rollout worker process, each Ray rollout actor). Light imports only: config validation uses this module."""

from __future__ import annotations

import inspect
from typing import Any

from vcpo.errors import UserError
from vcpo.plugins import PluginError, is_import_path, load_object, one_line

TASK_ATTRIBUTES = ("name", "problems", "reward")
"""What every task has (``vcpo.tasks.base.Task``)."""
ENV_ATTRIBUTES = ("max_turns", "max_total_tokens", "mask_void_turns", "step", "demonstration")
"""What a multi-turn environment has besides (``vcpo.envs.multiturn.MultiTurnEnv``); ``step`` marks one."""


class UserTaskError(UserError, ValueError):
    """A user's task that cannot be used; one line naming ``task.name`` or ``task.kwargs``."""


def is_user_task(name: str) -> bool:
    """Whether ``task.name`` names a task by import path; ``tools:<dataset>`` (``vcpo.tasks.tool_task``'s prefix)
    is vcpo's own tool task, not a module."""
    return is_import_path(name) and not name.startswith("tools:")


def load_task_factory(path: str) -> Any:
    """The class or factory at ``path``; a class must define every method of :data:`TASK_ATTRIBUTES`."""
    try:
        factory = load_object(path)
    except PluginError as e:
        raise UserTaskError(f"task.name {path!r}: {e.reason}") from None
    if not callable(factory):
        raise UserTaskError(f"task.name {path!r} is {type(factory).__name__} {factory!r}, not a class or factory")
    if isinstance(factory, type):
        missing = [a for a in ("problems", "reward") if not callable(getattr(factory, a, None))]
        if missing:
            raise UserTaskError(f"task.name {path!r}: class {factory.__name__} has no {' or '.join(missing)} method "
                                "(a task has name, problems(split, n, seed) and reward(problem, completion))")
    return factory


def check_user_task(path: str, kwargs: dict[str, Any]) -> None:
    """Import the task at ``path`` and check that ``task.kwargs`` fit its signature (when the config loads)."""
    factory = load_task_factory(path)
    try:
        signature = inspect.signature(factory)
    except ValueError:
        return
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        takes = ", ".join(signature.parameters) or "no arguments"
        raise UserTaskError(f"task.kwargs do not fit task {path!r} (it takes {takes}): {e}") from None


def make_user_task(path: str, kwargs: dict[str, Any]) -> Any:
    """``factory(**kwargs)`` of the task at ``path``, checked to be a task (and, if it has ``step``, a whole
    multi-turn environment)."""
    factory = load_task_factory(path)
    try:
        task = factory(**kwargs)
    except Exception as e:
        raise UserTaskError(f"task {path!r} with task.kwargs {kwargs!r} raised: {one_line(e)}") from None
    wanted = TASK_ATTRIBUTES + (ENV_ATTRIBUTES if hasattr(task, "step") else ())
    missing = [a for a in wanted if not hasattr(task, a)]
    if missing:
        kind = "multi-turn environment (it has step)" if hasattr(task, "step") else "task"
        raise UserTaskError(f"task {path!r} built a {type(task).__name__} that lacks {', '.join(missing)} to be a "
                            f"{kind}; see docs/extending.md")
    return task
