"""Tool tasks (``task.name: tools:<reasoning-gym dataset>``): reasoning-gym problems solved in SimpleTIR episodes,
the model's Python run in the sandbox, a plain reward on the final ``\\boxed{}`` answer."""

from __future__ import annotations

import ast
import operator
from typing import Any

from vcpo.envs.multiturn import EnvStep
from vcpo.envs.simpletir import BOXED_MARK, observation_text, parse_turn, run_tool_calls, tool_output
from vcpo.rewards.answers import last_boxed, normalize_number
from vcpo.rewards.pool import RewardOutcome
from vcpo.tasks.base import TaskError
from vcpo.tasks.reasoning_gym_task import ReasoningGymTask
from vcpo.types import Problem

TOOL_PREFIX = "tools:"
# The tool settings read from task.kwargs (the rest goes to the reasoning-gym dataset), with their defaults.
TOOL_SETTINGS: dict[str, Any] = {
    "max_turns": 3, "max_total_tokens": 160, "mask_void_turns": True, "tool_timeout_s": 5.0,
    "tool_memory_mb": 512, "tool_workers": 4, "answer_match": "exact",
}
_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


class ToolTask:
    """A reasoning-gym dataset as a multi-turn tool task (a :class:`~vcpo.tasks.base.Task` and a
    :class:`~vcpo.envs.multiturn.MultiTurnEnv`).

    The prompt is the dataset's expression (``"5179 * 2931 = ?\\n"``) when it has one, else its question. Each model
    turn is parsed with the SimpleTIR protocol (``vcpo.envs.simpletir``): a ``\\boxed{`` ends the episode and is
    scored; else the first fenced Python block runs in ``run_python`` (``tool_timeout_s``, ``tool_memory_mb``; the
    batch's calls ``tool_workers`` at a time) and its output comes back as the observation; a turn with neither is
    void and ends the episode. Reward: ``answer_match`` ``exact`` (the last boxed answer equals the reference as a
    string, ``1,000`` read as ``1000``) or ``math`` (:func:`vcpo.rewards.math_reward`).
    """

    def __init__(self, name: str, reward_timeout_s: float = 5.0, reward_workers: int = 1, **kwargs: Any) -> None:
        settings = {**TOOL_SETTINGS, **{k: kwargs.pop(k) for k in TOOL_SETTINGS if k in kwargs}}
        for key in ("max_turns", "max_total_tokens", "tool_memory_mb", "tool_workers"):
            if isinstance(settings[key], bool) or not isinstance(settings[key], int) or settings[key] < 1:
                raise TaskError(f"task.kwargs.{key} must be an integer >= 1, got {settings[key]!r}")
        if not isinstance(settings["tool_timeout_s"], int | float) or not 0 < settings["tool_timeout_s"] <= 3600:
            raise TaskError(f"task.kwargs.tool_timeout_s must be in (0, 3600], got {settings['tool_timeout_s']!r}")
        if settings["answer_match"] not in ("exact", "math"):
            raise TaskError(f"task.kwargs.answer_match must be 'exact' or 'math', got {settings['answer_match']!r}")
        if not isinstance(settings["mask_void_turns"], bool):
            raise TaskError(f"task.kwargs.mask_void_turns must be true or false, got {settings['mask_void_turns']!r}")
        self.name = name
        self.base = ReasoningGymTask(name.removeprefix(TOOL_PREFIX), reward_timeout_s, reward_workers, **kwargs)
        self.max_turns: int = settings["max_turns"]
        self.max_total_tokens: int = settings["max_total_tokens"]
        self.mask_void_turns: bool = settings["mask_void_turns"]
        self.tool_timeout_s = float(settings["tool_timeout_s"])
        self.tool_memory_mb: int = settings["tool_memory_mb"]
        self.tool_workers: int = settings["tool_workers"]
        self.answer_match: str = settings["answer_match"]

    def problems(self, split: str, n: int, seed: int) -> list[Problem]:
        """The dataset's problems of ``split`` (its train/eval separation) with the tool prompt."""
        out = []
        for p in self.base.problems(split, n, seed):
            expression = p.metadata["entry"]["metadata"].get("expression")
            prompt = f"{expression} = ?\n" if isinstance(expression, str) else f"{p.metadata['entry']['question']}\n"
            out.append(Problem(uid=p.uid, prompt=prompt, answer=p.answer, metadata=p.metadata))
        return out

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 when the final boxed answer of ``completion`` matches ``problem.answer`` (see ``answer_match``)."""
        if self.answer_match == "math":
            from vcpo.rewards import math_reward

            return math_reward(completion, problem.answer)
        answer = last_boxed(completion)
        return float(answer is not None and normalize_number(answer) == normalize_number(problem.answer))

    def score(self, problems: list[Problem], completions: list[str]) -> list[RewardOutcome]:
        """:meth:`reward` of each completion (a string comparison: nothing of the completion is executed)."""
        return [RewardOutcome(self.reward(p, c)) for p, c in zip(problems, completions, strict=True)]

    def step(self, tokenizer: Any, problems: list[Problem], turn_ids: list[list[int]], turn_index: int
             ) -> list[EnvStep]:
        """Answer one model turn of each episode: score an answer, run a code block (all in parallel), or end a
        void turn. The sampled ids are only decoded to be read; the observation is encoded on its own."""
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in turn_ids]
        parsed = [parse_turn(text) for text in texts]
        calls = [i for i, p in enumerate(parsed) if p.code is not None and not p.answered]
        results = dict(zip(calls, run_tool_calls([parsed[i].code for i in calls], self.tool_timeout_s,
                                                 self.tool_memory_mb, self.tool_workers), strict=True))
        steps: list[EnvStep] = []
        for i, (problem, text, p) in enumerate(zip(problems, texts, parsed, strict=True)):
            if p.answered:
                steps.append(EnvStep([], done=True, reward=self.reward(problem, text)))
            elif p.void:
                steps.append(EnvStep([], done=True, void=True))
            else:
                steps.append(self._observe(tokenizer, problem, results[i]))
        return steps

    def _observe(self, tokenizer: Any, problem: Problem, result: Any) -> EnvStep:
        """The observation of one tool run, or the end of the episode when its output holds the final answer
        (SimpleTIR ends there too)."""
        output, failed = tool_output(result)
        if BOXED_MARK in output:
            return EnvStep([], done=True, reward=self.reward(problem, output), tool_calls=1, tool_errors=int(failed))
        obs_ids = tokenizer(observation_text(output), add_special_tokens=False)["input_ids"]
        return EnvStep(obs_ids, done=False, tool_calls=1, tool_errors=int(failed))

    def demonstration(self, problem: Problem) -> list[tuple[str, bool]]:
        """A solved episode: ``print(<expression>)`` in a Python block, its output, the boxed answer.

        The output shown is the reference answer, checked against the expression's integer arithmetic here (no
        sandbox run per example: SFT needs tens of thousands); datasets without such an expression raise TaskError.
        """
        expression = problem.metadata["entry"]["metadata"].get("expression")
        if not isinstance(expression, str) or str(_integer_value(expression)) != problem.answer.strip():
            raise TaskError(f"task {self.name!r}: no solved tool transcript for {problem.prompt.strip()!r} "
                            "(the warm start needs an integer +, -, * expression whose value is the answer)")
        return [(f"```python\nprint({expression})\n```", True), (observation_text(problem.answer.strip()), False),
                (f"\\boxed{{{problem.answer.strip()}}}", True)]


def _integer_value(expression: str) -> int | None:
    """The value of an integer expression of +, -, * and parentheses (a generated problem, not model text)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            return _ARITHMETIC[type(node.op)](value(node.left), value(node.right))
        raise ValueError(ast.dump(node))

    try:
        return value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError):
        return None
