"""A user's own multi-turn environment: find a hidden number from "higher" / "lower" hints.

Named in the config by its import path (config.yaml here); vcpo builds it as ``GuessNumber(**task.kwargs)`` in the
trainer and in every rollout worker:

    task:
      name: guess_number:GuessNumber
      kwargs: {high: 31, max_turns: 6}

An episode, as the model sees it (``*`` marks the tokens it samples and is trained on):

    guess a number from 0 to 31        the prompt
    *15<eos>*                          model turn 1
    higher                             observation: environment tokens, mask 0, never trained on
    *23<eos>*                          model turn 2
    lower                              ...
    *19<eos>*                          right: the episode ends with reward 1

A turn that is not a number, or ``max_turns`` wrong guesses, ends the episode with reward 0. The prompt is the same
for every episode, so the model can only succeed by reading the hints: a policy that searches by halves finds any
of the 32 numbers in 6 turns, which is what the warm start demonstrates (:meth:`demonstration`).
"""

from __future__ import annotations

import random
import re
from typing import Any

from vcpo.envs.multiturn import EnvStep
from vcpo.types import Problem

_NUMBER = re.compile(r"-?\d+")


class GuessNumber:
    """A ``vcpo.tasks.base.Task`` and a ``vcpo.envs.multiturn.MultiTurnEnv``: ``problems`` draws hidden numbers,
    ``step`` answers each model turn, ``demonstration`` solves an episode for the supervised warm start."""

    def __init__(self, high: int = 31, max_turns: int = 6, max_total_tokens: int = 80) -> None:
        if high < 1 or max_turns < 1:
            raise ValueError(f"high and max_turns must be >= 1, got {high} and {max_turns}")
        self.name = f"guess_number_{high}"
        self.high = high
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.mask_void_turns = False  # a turn that is no number is a wrong answer here, not a void turn
        self.prompt = f"guess a number from 0 to {high}\n"

    def problems(self, split: str, n: int, seed: int) -> list[Problem]:
        """``n`` hidden numbers, the same for the same ``(split, seed)``; the splits draw from different streams."""
        rng = random.Random(f"{self.name}:{split}:{seed}")
        targets = [rng.randint(0, self.high) for _ in range(n)]
        return [Problem(uid=f"{self.name}/{split}/{seed}/{i}", prompt=self.prompt, answer=str(target))
                for i, target in enumerate(targets)]

    def step(self, tokenizer: Any, problems: list[Problem], turn_ids: list[list[int]], turn_index: int
             ) -> list[EnvStep]:
        """Score a right guess 1 and end; end a turn that is no number with 0; else hint with ids of its own."""
        steps = []
        for problem, ids in zip(problems, turn_ids, strict=True):
            guess = self._guess(tokenizer.decode(ids, skip_special_tokens=True))
            target = int(problem.answer)
            if guess is None or guess == target:
                steps.append(EnvStep([], done=True, reward=float(guess == target)))
            else:
                hint = "higher\n" if target > guess else "lower\n"
                steps.append(EnvStep(tokenizer(hint, add_special_tokens=False)["input_ids"], done=False))
        return steps

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 when the last number of a whole episode's text is the hidden one."""
        numbers = _NUMBER.findall(completion)
        return float(bool(numbers) and int(numbers[-1]) == int(problem.answer))

    def demonstration(self, problem: Problem) -> list[tuple[str, bool]]:
        """A solved episode by halving the interval: ``[("15", True), ("higher\\n", False), ("23", True), ...]``."""
        low, high, target, segments = 0, self.high, int(problem.answer), []
        while True:
            guess = (low + high) // 2
            segments.append((str(guess), True))
            if guess == target:
                return segments
            segments.append(("higher\n" if target > guess else "lower\n", False))
            low, high = (guess + 1, high) if target > guess else (low, guess - 1)

    @staticmethod
    def _guess(text: str) -> int | None:
        match = _NUMBER.fullmatch(text.strip())
        return int(match.group()) if match else None
