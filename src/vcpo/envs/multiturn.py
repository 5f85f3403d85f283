"""The multi-turn environment interface: after each model turn the environment answers with observation token ids,
or ends the episode with a reward. The rollout loop that drives it is ``vcpo.rollout.episodes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from vcpo.types import Problem


@dataclass
class EnvStep:
    """The environment's answer to one model turn.

    ``observation_ids`` are appended to the context after the turn's sampled ids (token ids, never re-encoded
    model text); they are not the model's, so they get loss mask 0. ``reward`` counts only when ``done``.
    ``void`` marks a turn with neither a tool call nor an answer: with SimpleTIR's void-turn masking its whole
    trajectory is left out of the loss.
    """

    observation_ids: list[int]
    done: bool
    reward: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    void: bool = False


@runtime_checkable
class MultiTurnEnv(Protocol):
    """A task whose episodes alternate model turns and environment observations.

    A model turn ends at EOS (the end-of-turn token, kept in the context as sampled) or at the per-turn token
    limit ``rollout.max_new_tokens``. ``step`` sees the sampled ids of the current turn of a batch of active
    episodes (``turn_index`` counts from 0) and answers each one; it may decode the ids to read them but must
    return observations as ids. An episode also ends after ``max_turns`` model turns or once its response
    (model and observation tokens) reaches ``max_total_tokens``; it then scores 0 unless the step said done.
    ``mask_void_turns`` says whether void turns take their trajectory out of the loss.
    """

    max_turns: int
    max_total_tokens: int
    mask_void_turns: bool

    def step(self, tokenizer: Any, problems: list[Problem], turn_ids: list[list[int]], turn_index: int
             ) -> list[EnvStep]: ...

    def demonstration(self, problem: Problem) -> list[tuple[str, bool]]:
        """A solved episode for the SFT warm start: text segments, each marked True when the model writes it
        (a model turn, trained on and followed by EOS) or False when the environment does (masked)."""
        ...


def is_multiturn(task: Any) -> bool:
    """Whether the trainer should roll ``task`` out as multi-turn episodes."""
    return isinstance(task, MultiTurnEnv)
