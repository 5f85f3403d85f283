"""Tasks from reasoning-gym: procedural problem streams (any dataset by name, e.g. ``gsm_symbolic``) scored by each
dataset's own ``score_answer`` or by math-verify, run in the sandboxed scoring pool (several scorers ``eval`` the
completion or parse it with sympy)."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import re
from typing import Any

import reasoning_gym
from reasoning_gym.factory import DATASETS

from vcpo.plugins import is_import_path
from vcpo.rewards.answers import normalize_number
from vcpo.rewards.pool import RewardOutcome, ScoreRequest, shared_pool
from vcpo.tasks.base import SPLITS, TaskError
from vcpo.tasks.prompts import PromptFormat
from vcpo.types import Problem

# Datasets whose question is a verbose wrapper around ``metadata["expression"]``: the prompt keeps only
# the expression, so a tiny character-level model reads a few characters instead of a sentence.
EXPRESSION_ONLY = frozenset({"chain_sum", "basic_arithmetic", "decimal_chain_sum"})
ANSWER_CUE = "Answer: "
_MAX_DRAWS_PER_PROBLEM = 50  # how hard to look for problems of one split before declaring the split empty
AUTO_REWARD_SAMPLE = 64  # answers drawn to decide task.reward=auto
_NUMBER = re.compile(r"-?(\d+(\.\d*)?|\.\d+)(/\d+)?")


def generator_seed(name: str, split: str, seed: int) -> int:
    """The reasoning-gym seed behind ``problems(split, n, seed)``: a 31-bit hash of all three.

    reasoning-gym draws item ``i`` from ``Random(seed + i)``, so nearby seeds give shifted copies of one
    stream; hashing spreads the streams of different (split, seed) pairs apart.
    """
    digest = hashlib.sha256(f"{name}:{split}:{seed}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1


def prompt_split(prompt: str) -> str:
    """The split a prompt belongs to (half of all prompts each), so no eval prompt is ever trained on."""
    return SPLITS[hashlib.sha256(prompt.encode()).digest()[0] & 1]


class ReasoningGymTask:
    """``reasoning_gym.create_dataset(name, **kwargs)`` as a :class:`~vcpo.tasks.base.Task`.

    Train and eval problems come from different generator seeds and, beyond that, from disjoint halves
    of the prompt space (by a hash of the prompt): small arithmetic spaces repeat prompts often, and a
    repeated prompt would make held-out accuracy measure memory. The raw prompt is the question followed by
    ``"Answer: "`` (for :data:`EXPRESSION_ONLY` datasets just ``"<expression> = "``; an instruction, when set, on
    the line before the cue); in chat format the question and the instruction are the user message
    (:class:`~vcpo.tasks.prompts.PromptFormat`). Rewards come from the dataset's scorer (``reward="native"``),
    math-verify against the dataset's answer (``"math"``; ``"auto"``: math when :meth:`numeric_answers`) or a user's
    ``fn(completion, answer)`` (``reward="module:fn"``), in the
    shared sandboxed pool of ``reward_workers`` processes, each completion within ``reward_timeout_s`` seconds.
    """

    def __init__(self, name: str, reward_timeout_s: float = 5.0, reward_workers: int = 1,
                 prompt_format: PromptFormat | None = None, reward: str = "native", **kwargs: Any) -> None:
        self.name = name
        self.kwargs = dict(kwargs)
        self.reward_timeout_s = reward_timeout_s
        self.reward_workers = reward_workers
        self.format = prompt_format or PromptFormat()
        _create(name, size=1, seed=0, kwargs=self.kwargs)  # bad settings fail here, in one line
        if reward not in ("native", "math", "auto") and not is_import_path(reward):
            raise TaskError(f"task.reward: {reward!r} is not one of native, math, auto or an import path module:fn")
        self.reward_path = reward if is_import_path(reward) else None
        self.scorer = ("user" if self.reward_path is not None else
                       "math" if reward == "math" or (reward == "auto" and self.numeric_answers()) else "reasoning_gym")

    def numeric_answers(self) -> bool:
        """Whether every one of :data:`AUTO_REWARD_SAMPLE` answers of the dataset is a number (``-3``, ``2.5``,
        ``1,000``, ``3/4``): then math-verify can judge a reasoning completion's final answer against it."""
        dataset = _create(self.name, size=AUTO_REWARD_SAMPLE, seed=0, kwargs=self.kwargs)
        return all(_NUMBER.fullmatch(normalize_number(str(dataset[i]["answer"]))) for i in range(AUTO_REWARD_SAMPLE))

    def prompt(self, entry: dict[str, Any]) -> str:
        """The raw-format text the model sees for one reasoning-gym item."""
        expression = entry["metadata"].get("expression")
        instruction = self.format.effective_instruction
        if self.name in EXPRESSION_ONLY and isinstance(expression, str) and not instruction:
            return f"{expression} = "
        return "\n".join([entry["question"].strip(), *([instruction] if instruction else []), ANSWER_CUE])

    def problems(self, split: str, n: int, seed: int) -> list[Problem]:
        """``n`` problems of ``split`` ("train" or "eval"), the same ones for the same ``seed``."""
        if split not in SPLITS:
            raise TaskError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
        base_seed = generator_seed(self.name, split, seed)
        out: list[Problem] = []
        drawn = 0
        while len(out) < n:
            if drawn >= _MAX_DRAWS_PER_PROBLEM * n + 100:
                raise TaskError(
                    f"task {self.name!r} gave only {len(out)} of {n} {split} problems in {drawn} draws "
                    "(its problem space is too small to split into train and eval)"
                )
            chunk = 2 * (n - len(out)) + 16  # about half of the prompts belong to the other split
            dataset = _create(self.name, size=chunk, seed=base_seed + drawn, kwargs=self.kwargs)
            for i in range(chunk):
                entry = dataset[i]
                prompt = self.prompt(entry)
                if prompt_split(prompt) == split and len(out) < n:
                    uid = f"{self.name}/{split}/{seed}/{len(out)}"
                    out.append(self.format.problem(uid, entry["question"].strip(), prompt, str(entry["answer"]),
                                                   {"entry": entry}))
            drawn += chunk
        return out

    def score(self, problems: list[Problem], completions: list[str]) -> list[RewardOutcome]:
        """The dataset's ``score_answer`` of each whitespace-stripped completion, clamped to [0, 1] (or math-verify
        of its final answer against the dataset's answer, when scored by math), in one batch.

        Scored in the sandboxed pool: a scorer that raises on malformed text (some do) scores 0 as ``error``,
        one that hangs past ``reward_timeout_s`` or crashes scores 0 as ``timeout`` / ``crash``.
        """
        requests = [self._request(p, c) for p, c in zip(problems, completions, strict=True)]
        return shared_pool(self.reward_workers).score(requests, self.reward_timeout_s)

    def _request(self, problem: Problem, completion: str) -> ScoreRequest:
        if self.scorer == "reasoning_gym":
            return ScoreRequest("reasoning_gym", (problem.metadata["entry"],), completion, self._setup())
        return ScoreRequest(self.scorer, (problem.answer,), completion, self._setup())

    def _setup(self) -> tuple:
        """What the pool's workers build once for this task's scorer."""
        return {"reasoning_gym": (self.name, self.kwargs), "user": (self.reward_path,), "math": ()}[self.scorer]

    def warm_up(self) -> None:
        """Start the scoring workers and build this dataset's scorer in them, in the background (it imports
        reasoning-gym there: seconds of CPU better spent while the trainer loads its model)."""
        shared_pool(self.reward_workers).warm_up([ScoreRequest(self.scorer, (), "", self._setup())])

    def reward(self, problem: Problem, completion: str) -> float:
        """:meth:`score` of one completion."""
        return self.score([problem], [completion])[0].reward


def _create(name: str, size: int, seed: int, kwargs: dict[str, Any]) -> Any:
    """``reasoning_gym.create_dataset`` with its errors turned into one-line :class:`TaskError`s."""
    if name not in DATASETS:
        close = difflib.get_close_matches(name, DATASETS, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "e.g. chain_sum, basic_arithmetic"
        raise TaskError(f"unknown reasoning-gym dataset {name!r} ({hint})")
    config_cls = DATASETS[name][1]
    valid = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    for key in kwargs:
        if key not in valid:
            raise TaskError(f"task.kwargs.{key}: not a setting of {name!r} (valid: {', '.join(valid)})")
    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **kwargs)
    except Exception as exc:
        detail = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise TaskError(f"task.kwargs {kwargs!r} rejected by {name!r}: {detail}") from None
