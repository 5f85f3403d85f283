"""From problems to scored trajectories: sample a group of responses per prompt and reward them."""

from __future__ import annotations

import torch

from vcpo.rollout.engine import WeightPoll
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
    """Generate ``group_size`` responses per problem in one engine call and score each with the task.

    Returns one list of trajectories per problem (a GRPO group), in the order of ``problems``.
    """
    prompt_ids = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]
    flat_prompts = [ids for ids in prompt_ids for _ in range(group_size)]
    generations = engine.generate(flat_prompts, sampling, weight_poll=weight_poll, generator=generator)
    groups: list[list[Trajectory]] = []
    for j, (problem, gid) in enumerate(zip(problems, group_ids, strict=True)):
        group = []
        for g in generations[j * group_size : (j + 1) * group_size]:
            text = tokenizer.decode(g.response_ids, skip_special_tokens=True)
            group.append(
                Trajectory(
                    problem_uid=problem.uid,
                    group_id=gid,
                    prompt_ids=list(prompt_ids[j]),
                    response_ids=list(g.response_ids),
                    behavior_logprobs=list(g.behavior_logprobs),
                    versions=list(g.versions),
                    reward=float(task.reward(problem, text)),
                    finished=g.finished,
                    sampling=sampling,
                    response_text=text,
                )
            )
        groups.append(group)
    return groups
