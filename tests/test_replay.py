"""TBA's replay buffer: sampling proportions, eviction by age / uses / capacity, provenance, exact state."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vcpo.config import ConfigError, load_config
from vcpo.orchestration.replay import ReplayBuffer, ReplayEntry, ReplaySource, split_groups
from vcpo.types import Batch, SamplingParams, Trajectory


def traj(group_id: int, versions: list[int], reward: float = 0.0) -> Trajectory:
    n = len(versions)
    return Trajectory(problem_uid=f"p{group_id}", group_id=group_id, prompt_ids=[1, 2], response_ids=[3] * n,
                      behavior_logprobs=[-0.1 * (group_id + 1 + i) for i in range(n)], versions=versions,
                      reward=reward, finished=True, sampling=SamplingParams())


def group(group_id: int, version: int, rewards: tuple[float, ...] = (0.0, 0.0)) -> list[Trajectory]:
    return [traj(group_id, [version, version], r) for r in rewards]


def buffer(**kw) -> ReplayBuffer:
    args = {"capacity": 100, "recent_fraction": 0.5, "priority_inv_temp": 1.0, "max_uses": 100, "max_age": 100,
            "seed": 0} | kw
    return ReplayBuffer(**args)


def test_counts_recent_then_prioritised_with_top_up():
    buf = buffer()
    buf.add([group(g, 0) for g in range(4)])  # older groups 0-3
    fresh = buf.add([group(g, 1) for g in range(4, 8)])
    # n = 4, recent_fraction 0.5: 2 drawn from this step's groups 4-7, 2 from the older 0-3.
    picked, m = buf.draw(fresh, 4, learner_version=1)
    assert sorted(e.group[0].group_id >= 4 for e in picked) == [False, False, True, True]
    assert m["replay/recent_frac"] == 0.5 and len({id(e) for e in picked}) == 4  # no group twice
    # recent_fraction 0.75 of 4 = 3 recent; only one older group left -> 3 + 1.
    buf = buffer(recent_fraction=0.75)
    buf.add([group(0, 0)])
    fresh = buf.add([group(g, 1) for g in range(1, 5)])
    picked, m = buf.draw(fresh, 4, learner_version=1)
    assert m["replay/recent_frac"] == 0.75
    # recent_fraction 0.25 of 4 = 1 recent wanted, but one older group exists: topped up to 3 recent + 1 older.
    buf = buffer(recent_fraction=0.25)
    buf.add([group(0, 0)])
    fresh = buf.add([group(g, 1) for g in range(1, 5)])
    _, m = buf.draw(fresh, 4, learner_version=1)
    assert m["replay/recent_frac"] == 0.75
    # The first step: nothing older; the whole draw is recent and a batch never exceeds the buffer.
    buf = buffer(recent_fraction=0.0)
    fresh = buf.add([group(g, 0) for g in range(3)])
    picked, m = buf.draw(fresh, 4, learner_version=0)
    assert len(picked) == 3 and m["replay/recent_frac"] == 1.0


def test_reward_priority_proportions_by_hand():
    # Mean rewards [0, 0, 1, 1], beta = ln 3 -> weights [1, 1, 3, 3] / 8: a single draw picks a
    # group of reward 1 with probability 6/8 = 0.75, each one 3/8.
    # Two draws without replacement: P({C, D}) = 3/8 * 3/5 + 3/8 * 3/5 = 9/20 = 0.45
    # (after C, the weights left are [1, 1, 3] / 5).
    pool = [ReplayEntry(group(g, 0, (r, r)), g) for g, r in enumerate([0.0, 0.0, 1.0, 1.0])]
    buf = buffer(priority_inv_temp=math.log(3.0))
    trials = 8000
    first = [buf._prioritised(pool, 1)[0].seq for _ in range(trials)]
    assert first.count(2) / trials == pytest.approx(3 / 8, abs=0.02)  # 4.7 standard errors of 0.0054
    assert first.count(0) / trials == pytest.approx(1 / 8, abs=0.015)
    pairs = [frozenset(e.seq for e in buf._prioritised(pool, 2)) for _ in range(trials)]
    assert pairs.count(frozenset({2, 3})) / trials == pytest.approx(0.45, abs=0.025)
    assert pairs.count(frozenset({0, 1})) / trials == pytest.approx(1 / 8 * 1 / 7 * 2, abs=0.01)  # 0.036
    # beta = 0: uniform, whatever the rewards.
    uniform = buffer(priority_inv_temp=0.0)
    first = [uniform._prioritised(pool, 1)[0].seq for _ in range(trials)]
    assert first.count(0) / trials == pytest.approx(0.25, abs=0.02)


def test_eviction_by_age_keeps_every_token_within_the_bound():
    # max_age 2 at learner version 3: groups of version 0 (age 3) go, 1 (age 2) and 3 (age 0) stay.
    # A group whose tokens span versions [0, 2] (in-flight update) has age 3 by its oldest token: it goes.
    buf = buffer(max_age=2, recent_fraction=0.0)
    buf.add([group(0, 0), group(1, 1), [traj(2, [0, 2]), traj(2, [2, 2])]])
    fresh = buf.add([group(3, 3)])
    picked, m = buf.draw(fresh, 4, learner_version=3)
    assert sorted(e.group[0].group_id for e in picked) == [1, 3]
    assert (m["replay/evicted_age"], m["replay/evicted_unused"]) == (2.0, 2.0)
    assert (m["replay/age_min"], m["replay/age_max"], m["replay/age_mean"]) == (0.0, 2.0, 1.0)
    assert m["replay/max_age"] == 2.0 and m["replay/buffer_groups"] == 2.0


def test_eviction_by_uses_and_capacity():
    # max_uses 2: a group drawn twice is evicted after its second use.
    buf = buffer(max_uses=2, recent_fraction=1.0)
    fresh = buf.add([group(0, 0)])
    picked, m = buf.draw(fresh, 1, learner_version=0)
    assert (m["replay/uses_max"], m["replay/evicted_uses"], m["replay/buffer_groups"]) == (1.0, 0.0, 1.0)
    picked, m = buf.draw([], 1, learner_version=1)  # no fresh group: the old one is replayed
    assert picked[0].group[0].group_id == 0 and m["replay/recent_frac"] == 0.0
    assert (m["replay/uses_max"], m["replay/evicted_uses"], m["replay/buffer_groups"]) == (2.0, 1.0, 0.0)
    # capacity 3 with 5 groups: the two of the oldest versions (then arrival) go before the draw.
    buf = buffer(capacity=3, recent_fraction=0.0)
    buf.add([group(0, 2), group(1, 0), group(2, 1)])
    fresh = buf.add([group(3, 1), group(4, 3)])
    picked, m = buf.draw(fresh, 5, learner_version=3)
    assert sorted(e.group[0].group_id for e in picked) == [0, 3, 4]  # versions 0 and 1 (earlier arrival) evicted
    assert m["replay/evicted_capacity"] == 2.0


def test_replayed_trajectories_keep_their_provenance_and_state_round_trips():
    original = [group(0, 0, (1.0, 0.0)), group(1, 0, (0.0, 0.0))]
    buf = buffer(recent_fraction=0.0)
    buf.draw(buf.add(original), 1, learner_version=0)
    restored = buffer(recent_fraction=0.0, seed=123)  # another seed: the RNG state comes from the state
    restored.load_state(json.loads(json.dumps(buf.state())))
    a, ma = buf.draw(buf.add([group(2, 1)]), 2, learner_version=1)
    b, mb = restored.draw(restored.add([group(2, 1)]), 2, learner_version=1)
    assert [e.group for e in a] == [e.group for e in b] and ma == mb
    replayed = [e for e in b if e.group[0].group_id < 2]
    assert replayed, "the draw should replay an old group"
    for entry in replayed:
        same = original[entry.group[0].group_id]
        assert [t.behavior_logprobs for t in entry.group] == [t.behavior_logprobs for t in same]
        assert [t.versions for t in entry.group] == [t.versions for t in same]
    # What the learner sees: the batch tensors of a replayed group are those of the original.
    batch_a = Batch.from_trajectories(replayed[0].group, pad_id=0)
    batch_b = Batch.from_trajectories(original[replayed[0].group[0].group_id], pad_id=0)
    assert batch_a.behavior_logprobs_BS.equal(batch_b.behavior_logprobs_BS)
    assert batch_a.versions_BS.equal(batch_b.versions_BS) and batch_a.group_ids_B.equal(batch_b.group_ids_B)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4)), min_size=1, max_size=12),
       st.integers(1, 6), st.floats(0, 1), st.integers(1, 3), st.integers(0, 3), st.integers(1, 5))
def test_invariants_of_any_sequence_of_steps(steps, capacity, recent_fraction, max_uses, max_age, n):
    # Each step: `fresh` new groups generated `lag` versions ago, then a draw of n groups.
    buf = buffer(capacity=max(capacity, 4), recent_fraction=recent_fraction, max_uses=max_uses, max_age=max_age)
    gid = 0
    for version, (fresh_count, lag) in enumerate(steps):
        fresh = buf.add([group(gid + i, max(version - lag, 0), (float(i % 2), 1.0)) for i in range(fresh_count)])
        gid += fresh_count
        picked, m = buf.draw(fresh, n, learner_version=version)
        assert len({id(e) for e in picked}) == len(picked) <= n  # never a group twice, never more than n
        assert all(e.age(version) <= max_age and 1 <= e.uses <= max_uses for e in picked)
        assert len(buf.entries) <= max(capacity, 4) and all(e.uses < max_uses for e in buf.entries)
        assert m["replay/age_max"] <= max_age and 0 <= m["replay/recent_frac"] <= 1


class ListSource:
    """A stand-in rollout source: batch v is two groups generated at version max(0, v - 1)."""

    def __init__(self) -> None:
        self.published: list[int] = []

    def next_batch(self, learner_version: int) -> list[Trajectory]:
        v = max(0, learner_version - 1)
        return [t for g in (2 * learner_version, 2 * learner_version + 1) for t in group(g, v, (float(g % 3), 0.0))]

    def publish(self, model, version: int) -> None:
        self.published.append(version)

    def metrics(self) -> dict[str, float]:
        return {"staleness/dropped_over_bound": 0.0}

    def state(self) -> dict:
        return {"inner": True}

    def load_state(self, state: dict) -> None:
        assert state == {"inner": True}

    def close(self) -> None:
        pass


def test_replay_source_wraps_any_source_and_resumes_exactly():
    def source() -> ReplaySource:
        return ReplaySource(ListSource(), buffer(max_age=2, capacity=6, max_uses=3), groups_per_step=3)

    full, first = source(), source()
    seen = [[t.group_id for t in full.next_batch(v)] for v in range(6)]
    for v in range(3):
        first.next_batch(v)
    resumed = source()
    resumed.load_state(json.loads(json.dumps(first.state())))
    assert [[t.group_id for t in resumed.next_batch(v)] for v in range(3, 6)] == seen[3:]
    m = full.metrics()
    assert m["replay/fresh_groups"] == 2.0 and m["replay/fresh_tokens"] == 8.0  # 2 groups x 2 x 2 tokens
    # batch 5 holds groups 10 and 11 with rewards (10 % 3, 0) = (1, 0) and (11 % 3, 0) = (2, 0): mean 3/4.
    assert m["replay/fresh_reward_mean"] == 0.75
    assert m["staleness/dropped_over_bound"] == 0.0 and m["replay/age_max"] <= 2
    assert all(len(ids) == 6 for ids in seen[1:])  # 3 whole groups of 2 once the buffer holds enough
    full.publish(None, 7)
    assert full.inner.published == [7]
    assert [len(g) for g in split_groups(full.next_batch(6))] == [2, 2, 2]


@pytest.mark.parametrize(("overrides", "named"), [
    (["async.replay.capacity=8"], "async.replay.capacity"),
    (["async.replay.generation_lag=3"], "async.replay.generation_lag"),
    (["async.mode=lagged"], "async.replay.generation_lag"),
    (["async.replay.recent_fraction=1.5"], "async.replay.recent_fraction"),
])
def test_replay_config_errors_name_the_key(overrides, named):
    base = ["async.replay.enabled=true", "async.max_staleness=2", "rollout.prompts_per_step=16"]
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(None, [*base, *overrides])
    lagged = load_config(None, [*base, "async.mode=lagged", "async.replay.generation_lag=1"])
    assert lagged.async_.generation_bound() == 1
