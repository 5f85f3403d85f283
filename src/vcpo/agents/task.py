"""Agent tasks (``task.name: agent:<module>:<function>``): any agent written for the OpenAI API, trained on the
tokens it had the policy sample. Its problems and its evaluation come from another task (``task.kwargs.problems``).
Light imports only: config validation uses this module; the endpoint's stack loads with the first collection."""

from __future__ import annotations

import atexit
import importlib.util
from typing import TYPE_CHECKING, Any

from vcpo.errors import UserError
from vcpo.plugins import PluginError, load_function
from vcpo.rewards.pool import RewardOutcome
from vcpo.types import Problem

if TYPE_CHECKING:
    from vcpo.agents.session import AgentSession
    from vcpo.config import TaskConfig

AGENT_PREFIX = "agent:"
AGENT_ARGUMENTS = ("base_url", "model", "problem")
# The agent settings read from task.kwargs, with their defaults (``problems`` has none: it must be given).
AGENT_SETTINGS: dict[str, Any] = {
    "problems": None, "problem_kwargs": {}, "agent_timeout_s": 300.0, "agent_retries": 0, "rows": "episode",
    "served_model": "policy",
}


class AgentTaskError(UserError, ValueError):
    """An agent task that cannot be used; one line naming ``task.name`` or the ``task.kwargs`` key."""


def is_agent_task_name(name: str) -> bool:
    return name.startswith(AGENT_PREFIX)


def agent_settings(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The checked settings of agent task ``name`` (its function imported and its signature checked)."""
    path = name.removeprefix(AGENT_PREFIX)
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise AgentTaskError(f"task.name {name!r}: the agent endpoint needs {' and '.join(missing)}: "
                             "pip install 'vcpo[agent]'")
    try:
        load_function(path, AGENT_ARGUMENTS)
    except PluginError as e:
        raise AgentTaskError(f"task.name {name!r}: {e.reason}") from None
    unknown = sorted(set(kwargs) - set(AGENT_SETTINGS))
    if unknown:
        raise AgentTaskError(f"task.kwargs.{unknown[0]} is not an agent task setting (they are "
                             f"{', '.join(AGENT_SETTINGS)}; the problem task's own go in task.kwargs.problem_kwargs)")
    settings = {**AGENT_SETTINGS, **kwargs}
    problems = settings["problems"]
    if not isinstance(problems, str) or not problems or is_agent_task_name(problems):
        raise AgentTaskError(f"task {name!r} needs task.kwargs.problems: the task its problems come from (e.g. "
                             f"chain_sum or jsonl, not another agent), got {problems!r}")
    if not isinstance(settings["problem_kwargs"], dict):
        raise AgentTaskError(f"task.kwargs.problem_kwargs must be a mapping, got {settings['problem_kwargs']!r}")
    timeout = settings["agent_timeout_s"]
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 86400:
        raise AgentTaskError(f"task.kwargs.agent_timeout_s must be in (0, 86400], got {timeout!r}")
    retries = settings["agent_retries"]
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 10:
        raise AgentTaskError(f"task.kwargs.agent_retries must be an integer in [0, 10], got {retries!r}")
    if settings["rows"] not in ("episode", "call"):
        raise AgentTaskError(f"task.kwargs.rows must be 'episode' or 'call', got {settings['rows']!r}")
    if not isinstance(settings["served_model"], str) or not settings["served_model"]:
        raise AgentTaskError(f"task.kwargs.served_model must be a non-empty string, got {settings['served_model']!r}")
    return settings


def problem_task_config(config: TaskConfig) -> TaskConfig:
    """The config of an agent task's problem task: ``task.kwargs.problems`` with ``problem_kwargs`` (prompt format,
    reward and scoring settings shared)."""
    from vcpo.config import TaskConfig

    settings = {**AGENT_SETTINGS, **config.kwargs}
    fields = config.model_dump() | {"name": settings["problems"], "kwargs": dict(settings["problem_kwargs"] or {})}
    return TaskConfig(**fields)


class AgentTask:
    """An agent function trained through the run's OpenAI-compatible endpoint (a :class:`~vcpo.tasks.base.Task`).

    ``problems``, ``reward`` and ``score`` are the problem task's (``base``), and so are held-out evaluation and the
    warm start (``vcpo.train.evaluate``, ``vcpo.train.sft``): the agent runs only in training rollouts, which go through
    :func:`vcpo.agents.collect.collect_agent_groups`, which the agent's endpoint and runner process serve; both
    start with the first collection and stop with :meth:`close` (or at exit).
    """

    def __init__(self, config: TaskConfig) -> None:
        from vcpo.tasks import make_task

        settings = agent_settings(config.name, config.kwargs)
        self.name = config.name
        self.agent_path = config.name.removeprefix(AGENT_PREFIX)
        self.base = make_task(problem_task_config(config))
        self.timeout_s = float(settings["agent_timeout_s"])
        self.retries: int = settings["agent_retries"]
        self.rows_per_call = settings["rows"] == "call"
        self.served_model: str = settings["served_model"]
        self._session: AgentSession | None = None

    def problems(self, split: str, n: int, seed: int) -> list[Problem]:
        return self.base.problems(split, n, seed)

    def reward(self, problem: Problem, completion: str) -> float:
        return self.base.reward(problem, completion)

    def score(self, problems: list[Problem], completions: list[str]) -> list[RewardOutcome]:
        from vcpo.tasks.base import score_completions

        return score_completions(self.base, problems, completions)

    def warm_up(self) -> None:
        from vcpo.tasks.base import prepare_scoring

        prepare_scoring(self.base)

    def session(self, tokenizer: Any, max_new_tokens: int) -> AgentSession:
        """The endpoint and runner of this process, started on first use."""
        from vcpo.agents.session import AgentSession

        if self._session is None or self._session.max_new_tokens != max_new_tokens:
            self.close()
            self._session = AgentSession(self.agent_path, tokenizer, self.served_model, max_new_tokens)
            atexit.register(self.close)
        return self._session

    def close(self) -> None:
        """Stop the endpoint and the runner process (every agent still running dies with it)."""
        if self._session is not None:
            self._session.close()
            self._session = None


def is_agent_task(task: Any) -> bool:
    return isinstance(task, AgentTask)
