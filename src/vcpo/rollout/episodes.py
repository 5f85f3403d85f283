"""Multi-turn rollouts: drive a batch of episodes of a ``MultiTurnEnv`` turn by turn through any rollout engine.

Token-in, token-out: each turn is one ``engine.generate`` call on the context ids (prompt, then every sampled id and
observation id so far, exactly as produced); sampled ids are decoded only to be read, never re-encoded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vcpo.envs.multiturn import MultiTurnEnv
from vcpo.rollout.engine import RolloutEngine, WeightPoll
from vcpo.types import Problem, SamplingParams


@dataclass
class Episode:
    """One episode's response: model and observation tokens in order, with the model tokens' provenance.

    ``behavior_logprobs`` is 0 and ``versions`` repeats the version of the model token before it on observation
    tokens (so the oldest version of the episode is that of a model token); ``mask`` tells them apart.
    """

    response_ids: list[int] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    finished: bool = False  # ended by the environment (an answer), not by a turn or token budget
    void: bool = False
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0

    def stats(self) -> dict[str, float]:
        """Per-episode counts, averaged or summed into ``tools/*`` metrics by the trainer."""
        return {"turns": float(self.turns), "tool_calls": float(self.tool_calls),
                "tool_errors": float(self.tool_errors), "void": float(self.void)}


def run_episodes(
    engine: RolloutEngine,
    tokenizer: Any,
    env: MultiTurnEnv,
    problems: list[Problem],
    prompt_ids: list[list[int]],
    sampling: SamplingParams,
    *,
    generator: torch.Generator | None = None,
    weight_poll: WeightPoll | None = None,
    greedy: bool = False,
) -> list[Episode]:
    """Roll out one episode per prompt: per turn, the active episodes are generated in one batched engine call,
    then the environment answers all of them in one ``step`` (which may run their tool calls in parallel).

    A turn may span policy versions (``weight_poll`` applies new weights between decode steps); every sampled
    token keeps its own behavior log-prob and version. A turn is capped at ``sampling.max_new_tokens`` and at
    what is left of ``env.max_total_tokens``; an episode ends when the environment says done, after
    ``env.max_turns`` turns, or when its budget is spent (then the observation is not appended).
    """
    episodes = [Episode() for _ in problems]
    contexts = [list(ids) for ids in prompt_ids]
    active = list(range(len(problems)))
    for turn in range(env.max_turns):
        budget = {i: env.max_total_tokens - len(episodes[i].response_ids) for i in active}
        active = [i for i in active if budget[i] > 0]
        if not active:
            break
        # One generate call per distinct turn limit keeps the request shape the engines know (rarely more than 2).
        limits = sorted({min(sampling.max_new_tokens, budget[i]) for i in active})
        generations: dict[int, Any] = {}
        for limit in limits:
            rows = [i for i in active if min(sampling.max_new_tokens, budget[i]) == limit]
            turn_sampling = SamplingParams(sampling.temperature, sampling.top_p, limit)
            outs = engine.generate([contexts[i] for i in rows], turn_sampling, weight_poll=weight_poll,
                                   generator=generator, greedy=greedy)
            generations.update(zip(rows, outs, strict=True))
        steps = env.step(tokenizer, [problems[i] for i in active], [generations[i].response_ids for i in active],
                         turn)
        still_active = []
        for i, step in zip(active, steps, strict=True):
            ep, gen = episodes[i], generations[i]
            ep.response_ids += gen.response_ids
            ep.behavior_logprobs += gen.behavior_logprobs
            ep.versions += gen.versions
            ep.mask += [1] * len(gen.response_ids)
            contexts[i] += gen.response_ids
            ep.turns += 1
            ep.tool_calls += step.tool_calls
            ep.tool_errors += step.tool_errors
            ep.void = ep.void or step.void
            if step.done:
                ep.reward, ep.finished = float(step.reward), True
                continue
            obs = list(step.observation_ids)
            if turn + 1 == env.max_turns or len(ep.response_ids) + len(obs) >= env.max_total_tokens:
                continue  # no model turn would follow the observation: the episode ends unanswered
            last_version = ep.versions[-1] if ep.versions else engine.version
            ep.response_ids += obs
            ep.behavior_logprobs += [0.0] * len(obs)
            ep.versions += [last_version] * len(obs)
            ep.mask += [0] * len(obs)
            contexts[i] += obs
            still_active.append(i)
        active = still_active
    return episodes
