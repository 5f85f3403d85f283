"""``task``: which task, its own kwargs, the evaluation set."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from vcpo.config.base import _Strict
from vcpo.plugins import PluginError, is_import_path, load_function


class TaskConfig(_Strict):
    """What the policy learns to solve: the problems, their prompts, their rewards."""

    name: str = "chain_sum"
    """A reasoning-gym dataset name, ``jsonl`` / ``parquet`` for a local dataset file (docs/datasets.md),
    ``tools:<dataset>`` for its multi-turn tool task (docs/tools.md), ``agent:<module>:<function>`` for an agent
    written for the OpenAI API (docs/agents.md), or ``module.sub:Name``: your own task or multi-turn environment, a
    class or factory called with ``kwargs`` (docs/extending.md)."""
    kwargs: dict[str, Any] = Field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
    )
    """The task's own settings (the default is chain_sum's; another task named without kwargs gets none): the
    reasoning-gym dataset config (e.g. digit counts); for ``jsonl`` / ``parquet``: ``path`` (or ``train_path`` and
    ``eval_path``), ``prompt_field``, ``answer_field``, ``answer_format``, ``eval_fraction``; for ``agent:...``:
    ``problems`` (the task its problems come from), ``problem_kwargs`` (that task's kwargs), ``agent_timeout_s``,
    ``agent_retries``, ``rows`` and ``served_model`` (docs/agents.md)."""
    prompt_format: Literal["raw", "chat"] = "raw"
    """``raw``: the prompt text as is; ``chat``: the tokenizer's chat template (an error when it has none)."""
    system_prompt: str | None = None
    """Chat format: a system message before the problem; None = none."""
    instruction: str | None = None
    """Appended to the problem on its own line; None = the format's default ("Please reason step by step, and put
    your final answer within \\boxed{}." in chat format, nothing in raw format); "" = none."""
    reward: str = "native"
    """reasoning-gym tasks: ``native`` = the dataset's own scorer, ``math`` = math-verify on the reference answer,
    ``auto`` = math when every one of 64 sampled answers is a number; dataset files are scored by math. Either
    kind of task: ``module.sub:function``, your own ``function(completion, answer) -> float`` in [0, 1], run in the
    sandboxed scoring pool (docs/extending.md)."""
    eval_size: int = Field(500, gt=0)
    """Held-out problems for ``eval/accuracy`` (a separate seed from the training stream)."""
    reward_timeout_s: float = Field(5.0, gt=0, le=3600)
    """Wall-clock limit per scored completion; past it the sandboxed scorer is killed and the reward is 0."""
    reward_workers: int = Field(1, gt=0, le=64)
    """Sandboxed scoring processes per process that scores (the trainer; each async rollout worker). Each
    costs a second or more of CPU to import its scorer's libraries; more help when scoring is slow."""

    @model_validator(mode="before")
    @classmethod
    def _kwargs_of_the_default_task(cls, data: Any) -> Any:
        """The default kwargs are chain_sum's: another task named without kwargs gets none."""
        if isinstance(data, dict) and "kwargs" not in data and data.get("name", "chain_sum") != "chain_sum":
            return {**data, "kwargs": {}}
        return data

    @field_validator("reward")
    @classmethod
    def _reward(cls, v: str) -> str:
        if v in ("native", "math", "auto"):
            return v
        if not is_import_path(v):
            raise ValueError("must be native, math, auto, or an import path module.sub:function")
        from vcpo.rewards.scorers import REWARD_ARGUMENTS

        try:
            load_function(v, REWARD_ARGUMENTS)
        except PluginError as e:
            raise ValueError(e.reason) from None
        return v

    @model_validator(mode="after")
    def _dataset_files(self) -> TaskConfig:
        from vcpo.tasks.records import DATASET_TASKS, check_dataset_kwargs
        from vcpo.tasks.user_task import check_user_task, is_user_task

        if self.name.startswith("agent:"):
            from vcpo.agents.task import agent_settings, problem_task_config

            agent_settings(self.name, self.kwargs)
            problem_task_config(self)  # the problem task's own checks
        elif self.name in DATASET_TASKS:
            check_dataset_kwargs(self.name, self.kwargs)
        elif is_user_task(self.name):
            check_user_task(self.name, self.kwargs)
        if is_import_path(self.reward) and (is_user_task(self.name) or self.name.startswith("tools:")):
            raise ValueError(f"task.reward={self.reward!r} scores reasoning-gym and dataset tasks; task {self.name!r} "
                             "scores its own completions")
        return self


