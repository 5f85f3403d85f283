"""Agent rollouts: run ``group_size`` agent episodes per problem at once, answer their endpoint calls with the run's
rollout engine in batches, and turn each episode's recorded calls into trajectories.

The collecting thread owns the engine: it takes the calls the endpoint filed, samples them in one ``generate`` per
token limit (with ``weight_poll``, so a call may span policy versions), and watches the agents' outcomes and the
deadline. A group is trained only when every episode of it returned a reward after calling the endpoint, and none
called it after its end; otherwise the group is retried (``agent_retries``) and then dropped: one line per failure,
and a marker group (``vcpo.types.DROPPED``) that the rollout sources count as ``agent/dropped_groups``.
"""

from __future__ import annotations

import sys
import time
import uuid
from typing import Any

import torch

from vcpo.agents.episodes import DROPPED, Call, Episode, PendingCall
from vcpo.agents.task import AgentTask
from vcpo.rollout.engine import RolloutEngine, WeightPoll
from vcpo.types import DROPPED_STATUS, Problem, SamplingParams, Trajectory

BATCH_WAIT_S = 0.02
"""How long the collector waits for more calls to join a batch (or for the first call)."""


def _say(line: str) -> None:
    """One line on stderr (never wrapped: a log line per failure)."""
    print(line, file=sys.stderr, flush=True)


def collect_agent_groups(engine: RolloutEngine, tokenizer: Any, task: AgentTask, problems: list[Problem],
                         group_ids: list[int], group_size: int, sampling: SamplingParams,
                         generator: torch.Generator | None = None, weight_poll: WeightPoll | None = None
                         ) -> list[list[Trajectory]]:
    """One group of trajectories per problem (``collect_groups``' contract); a group whose agents failed after
    ``task.retries`` retries is a one-row dropped marker (reward status ``dropped``, not trainable)."""
    session = task.session(tokenizer, sampling.max_new_tokens)
    groups: dict[int, list[Trajectory]] = {}
    todo = list(range(len(problems)))
    for attempt in range(task.retries + 1):
        episodes = _run_round(session, engine, task, problems, todo, group_ids, group_size, sampling, generator,
                              weight_poll, attempt)
        failed = []
        for j in todo:
            mine = episodes[j]
            if any(e.state == DROPPED or e.late_calls for e, _ in mine):
                failed.append(j)
            else:
                groups[j] = [row for e, reward in mine for row in _rows(e, reward, problems[j], group_ids[j],
                                                                        sampling, tokenizer, task.rows_per_call)]
        session.book.close([e.id for j in todo for e, _ in episodes[j]])
        todo = failed
        if not todo:
            break
        if attempt < task.retries:
            _say(f"agent {task.agent_path}: retrying {len(todo)} group(s) (attempt {attempt + 2} of "
                          f"{task.retries + 1})")
    for j in todo:
        _say(f"agent {task.agent_path}: group {group_ids[j]} (problem {problems[j].uid}) dropped")
        groups[j] = [_dropped(problems[j], group_ids[j], sampling, tokenizer)]
    return [groups[j] for j in range(len(problems))]


def _run_round(session: Any, engine: RolloutEngine, task: AgentTask, problems: list[Problem], todo: list[int],
               group_ids: list[int], group_size: int, sampling: SamplingParams, generator: torch.Generator | None,
               weight_poll: WeightPoll | None, attempt: int) -> dict[int, list[tuple[Episode, float]]]:
    """Run every episode of the groups ``todo`` to its end; each problem's (episode, reward) pairs."""
    book, runner = session.book, session.runner()
    owner = {f"g{group_ids[j]}a{attempt}e{s}-{uuid.uuid4().hex[:8]}": j for j in todo for s in range(group_size)}
    book.open(list(owner))
    for episode_id, j in owner.items():
        runner.start(episode_id, session.server.base_url(episode_id), task.served_model, problems[j])
    rewards: dict[str, float] = {}
    reported: set[str] = set()  # episodes whose agent returned or raised (its thread is done)
    deadline = time.monotonic() + task.timeout_s
    while running := book.running():
        calls = book.take(BATCH_WAIT_S, expected=len(running))
        if calls:
            _answer(engine, calls, sampling, generator, weight_poll)
        for episode_id, kind, value in runner.outcomes(0.0):
            reported.add(episode_id)
            episode = book.episode(episode_id)
            if episode is None or episode.state != "running":
                continue
            if kind == "error":
                _fail(book, task, episode_id, owner, problems, value)
            elif not episode.calls:
                _fail(book, task, episode_id, owner, problems, "returned without calling the endpoint")
            else:
                rewards[episode_id] = value
                book.end(episode_id)
        if not runner.alive():
            for episode_id in book.running():
                _fail(book, task, episode_id, owner, problems, f"lost its runner process (exit code "
                                                               f"{runner.exit_code})")
        if time.monotonic() > deadline:
            for episode_id in book.running():
                _fail(book, task, episode_id, owner, problems,
                      f"timed out after task.kwargs.agent_timeout_s={task.timeout_s:g} s")
    if len(reported) < len(owner):  # agents that did not return may still run: none outlives the collection
        session.stop_runner()
    out: dict[int, list[tuple[Episode, float]]] = {j: [] for j in todo}
    for episode_id, j in owner.items():
        episode = book.episode(episode_id)
        if episode is not None and episode.late_calls and episode.state != DROPPED:
            _say(f"agent {task.agent_path} episode {episode_id} (problem {problems[j].uid}) called the "
                          f"endpoint {episode.late_calls} time(s) after it returned; its group is not trained")
        out[j].append((episode, rewards.get(episode_id, 0.0)))
    return out


def _fail(book: Any, task: AgentTask, episode_id: str, owner: dict[str, int], problems: list[Problem],
          reason: str) -> None:
    _say(f"agent {task.agent_path} episode {episode_id} (problem {problems[owner[episode_id]].uid}) "
                  f"{reason}; its group is not trained")
    book.end(episode_id, reason)


def _answer(engine: RolloutEngine, calls: list[PendingCall], sampling: SamplingParams,
            generator: torch.Generator | None, weight_poll: WeightPoll | None) -> None:
    """Sample every call, one ``generate`` per distinct token limit, and hand each its generation."""
    for limit in sorted({min(c.max_tokens, sampling.max_new_tokens) for c in calls}):
        batch = [c for c in calls if min(c.max_tokens, sampling.max_new_tokens) == limit]
        try:
            generations = engine.generate([c.prompt_ids for c in batch],
                                          SamplingParams(sampling.temperature, sampling.top_p, limit),
                                          weight_poll=weight_poll, generator=generator)
        except BaseException as e:
            for c in calls:
                if not c.future.done():
                    c.future.set_exception(RuntimeError(f"generation failed: {type(e).__name__}"))
            raise
        for call, generation in zip(batch, generations, strict=True):
            call.future.set_result(generation)


def _rows(episode: Episode, reward: float, problem: Problem, group_id: int, sampling: SamplingParams,
          tokenizer: Any, per_call: bool) -> list[Trajectory]:
    """The episode's trajectories: consecutive calls whose prompt extends the context so far join one row (the
    tokens in between are masked: tool output, new messages, template text), any other call starts a new row
    (with ``per_call`` every call does). Every row carries the episode's reward."""
    rows: list[list[Call]] = []
    for call in episode.calls:
        if rows and not per_call and call.prompt_ids[: len(_context(rows[-1]))] == _context(rows[-1]):
            rows[-1].append(call)
        else:
            rows.append([call])
    stats = {"turns": float(len(episode.calls)), "tool_calls": float(episode.tool_calls), "tool_errors": 0.0,
             "void": 0.0, "agent_rows": float(len(rows))}
    return [_trajectory(row, reward, problem, group_id, sampling, tokenizer, stats) for row in rows]


def _context(calls: list[Call]) -> list[int]:
    return calls[-1].context_ids


def _trajectory(calls: list[Call], reward: float, problem: Problem, group_id: int, sampling: SamplingParams,
                tokenizer: Any, stats: dict[str, float]) -> Trajectory:
    first = calls[0]
    ids, logprobs, versions = list(first.response_ids), list(first.behavior_logprobs), list(first.versions)
    mask = [1] * len(ids)
    context = first.context_ids
    for call in calls[1:]:
        between = call.prompt_ids[len(context):]
        last_version = versions[-1] if versions else (call.versions[0] if call.versions else 0)
        ids += between + call.response_ids
        logprobs += [0.0] * len(between) + call.behavior_logprobs
        versions += [last_version] * len(between) + call.versions
        mask += [0] * len(between) + [1] * len(call.response_ids)
        context = call.context_ids
    return Trajectory(problem_uid=problem.uid, group_id=group_id, prompt_ids=list(first.prompt_ids),
                      response_ids=ids, behavior_logprobs=logprobs, versions=versions, reward=float(reward),
                      finished=calls[-1].finished, sampling=sampling,
                      response_text=tokenizer.decode(ids, skip_special_tokens=True), response_mask=mask,
                      env_stats=dict(stats))


def _dropped(problem: Problem, group_id: int, sampling: SamplingParams, tokenizer: Any) -> Trajectory:
    """The marker of a dropped group: no response, not trainable, reward status ``dropped``."""
    prompt_ids = list(tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]) or [tokenizer.eos_token_id]
    return Trajectory(problem_uid=problem.uid, group_id=group_id, prompt_ids=prompt_ids, response_ids=[],
                      behavior_logprobs=[], versions=[], reward=0.0, finished=False, sampling=sampling,
                      reward_status=DROPPED_STATUS, trainable=False)
