"""From problems to scored trajectories: sample a group of responses per prompt and reward them."""

from __future__ import annotations

import torch

from vcpo.envs.multiturn import is_multiturn
from vcpo.rollout.engine import WeightPoll
from vcpo.rollout.episodes import run_episodes
from vcpo.tasks.base import score_completions
from vcpo.tasks.prompts import encode_prompts
from vcpo.types import Problem, SamplingParams, Trajectory


def collect_groups(
    engine,
    tokenizer,
    task,
    problems: list[Problem],
    group_ids: list[int],
    group_size: int,
    sampling: SamplingParams,
    generator: torch.Generator,
    weight_poll: WeightPoll | None = None,
) -> list[list[Trajectory]]:
    """Generate ``group_size`` responses per problem in one engine call and score them with the task in one batch
    (one round trip to the sandboxed scoring pool per worker).

    Returns one list of trajectories per problem (a GRPO group), in the order of ``problems``; each carries its
    reward's status (``ok``, ``error``, ``crash``, ``timeout``), so the step that trains on it can count them.
    An agent task (``vcpo.agents``) runs its agents against the run's endpoint instead; a group it drops is a
    one-row marker (``vcpo.types.is_dropped_group``).
    """
    from vcpo.agents.task import is_agent_task

    if is_agent_task(task):
        from vcpo.agents.collect import collect_agent_groups

        return collect_agent_groups(engine, tokenizer, task, problems, group_ids, group_size, sampling, generator,
                                    weight_poll)
    prompt_ids = encode_prompts(tokenizer, problems)  # once: these ids are sampled from and trained on
    flat_prompts = [ids for ids in prompt_ids for _ in range(group_size)]
    if is_multiturn(task):
        return _collect_episodes(engine, tokenizer, task, problems, group_ids, group_size, sampling, generator,
                                 weight_poll, prompt_ids)
    generations = engine.generate(flat_prompts, sampling, weight_poll=weight_poll, generator=generator)
    texts = [tokenizer.decode(g.response_ids, skip_special_tokens=True) for g in generations]
    outcomes = score_completions(task, [p for p in problems for _ in range(group_size)], texts)
    groups: list[list[Trajectory]] = []
    for j, (problem, gid) in enumerate(zip(problems, group_ids, strict=True)):
        group = []
        for i in range(j * group_size, (j + 1) * group_size):
            g, text, outcome = generations[i], texts[i], outcomes[i]
            group.append(
                Trajectory(
                    problem_uid=problem.uid,
                    group_id=gid,
                    prompt_ids=list(prompt_ids[j]),
                    response_ids=list(g.response_ids),
                    behavior_logprobs=list(g.behavior_logprobs),
                    versions=list(g.versions),
                    reward=outcome.reward,
                    finished=g.finished,
                    sampling=sampling,
                    response_text=text,
                    reward_status=outcome.status,
                )
            )
        groups.append(group)
    return groups


def _collect_episodes(engine, tokenizer, task, problems: list[Problem], group_ids: list[int], group_size: int,
                      sampling: SamplingParams, generator: torch.Generator, weight_poll: WeightPoll | None,
                      prompt_ids: list[list[int]]) -> list[list[Trajectory]]:
    """``collect_groups`` for a multi-turn task: the environment scores each episode as it ends."""
    flat_problems = [p for p in problems for _ in range(group_size)]
    episodes = run_episodes(engine, tokenizer, task, flat_problems, [ids for ids in prompt_ids for _ in
                            range(group_size)], sampling, generator=generator, weight_poll=weight_poll)
    groups: list[list[Trajectory]] = []
    for j, (problem, gid) in enumerate(zip(problems, group_ids, strict=True)):
        groups.append([
            Trajectory(
                problem_uid=problem.uid, group_id=gid, prompt_ids=list(prompt_ids[j]), response_ids=ep.response_ids,
                behavior_logprobs=ep.behavior_logprobs, versions=ep.versions, reward=ep.reward,
                finished=ep.finished, sampling=sampling,
                response_text=tokenizer.decode(ep.response_ids, skip_special_tokens=True),
                response_mask=ep.mask, trainable=not (ep.void and task.mask_void_turns), env_stats=ep.stats(),
            )
            for ep in episodes[j * group_size : (j + 1) * group_size]
        ])
    return groups
