"""Dynamic sampling (``rollout.filter: zero_variance``): the filter and its cap by hand, the capacity a dropped group
returns, and the real trainer in sync, lagged (deterministic, exact resume) and async mode, with what each step
trained on in ``trained_groups.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vcpo.config import load_config
from vcpo.orchestration.filtering import DynamicSampling, StepFill, in_band, informative
from vcpo.orchestration.staleness import StalenessController
from vcpo.orchestration.tally import GroupTally
from vcpo.types import SamplingParams, Trajectory

from conftest import metrics, vcpo

FILTER = ["rollout.filter=zero_variance", "rollout.filter_max_factor=6"]


def _group(gid: int, rewards: list[float], length: int = 2) -> list[Trajectory]:
    return [Trajectory("u", gid, [1], [2] * length, [-0.1] * length, [0] * length, r, True, SamplingParams())
            for r in rewards]


def test_a_group_is_informative_when_its_rewards_differ():
    assert informative(_group(0, [0.0, 1.0, 0.0]))
    assert informative(_group(0, [0.5, 0.25]))
    assert not informative(_group(0, [1.0, 1.0, 1.0]))
    assert not informative(_group(0, [0.0, 0.0]))


def test_the_pass_rate_band_keeps_informative_groups_inside_it_ends_included():
    band = DynamicSampling(2, 4.0, (0.2, 0.8))
    assert band.keeps(_group(0, [1, 0, 0, 0, 0]))  # 0.2: the low end
    assert band.keeps(_group(0, [1, 1, 1, 1, 0]))  # 0.8: the high end
    assert band.keeps(_group(0, [1, 0]))  # 0.5
    assert not band.keeps(_group(0, [1, 0, 0, 0, 0, 0, 0, 0]))  # 0.125: solved once in eight
    assert not band.keeps(_group(0, [1, 1, 1, 1, 1, 1, 1, 0]))  # 0.875
    assert not band.keeps(_group(0, [0.5, 0.5]))  # in the band but without signal
    assert in_band(_group(0, [0.5, 0.5]), (0.2, 0.8)) and not in_band(_group(0, [1, 1]), (0.2, 0.8))
    # the default band is the zero-variance rule alone
    for rewards in ([1, 0, 0, 0, 0, 0, 0, 0], [1, 1], [0, 0], [0.25, 0.5]):
        assert DynamicSampling(2, 4.0).keeps(_group(0, rewards)) == informative(_group(0, rewards))


def test_a_step_under_a_band_drops_and_refills_groups_outside_it():
    # P = 2, band [0.25, 0.75]: 1/8 (dropped), 1/2 (kept), tie (dropped), 3/4 (kept) -> 2 of 4 dropped
    fill = DynamicSampling(2, 4.0, (0.25, 0.75)).fill()
    for gid, rewards in enumerate([[1, 0, 0, 0, 0, 0, 0, 0], [1, 0], [1, 1], [1, 1, 1, 0]]):
        fill.offer(_group(gid, rewards))
    groups, m = fill.result()
    assert fill.done and [g[0].group_id for g in groups] == [1, 3] and m["filter/dropped_frac"] == 0.5


def test_the_trainer_builds_the_band_from_the_config():
    from vcpo.loop.trainer import dynamic_sampling
    band = ["rollout.filter=zero_variance", "rollout.filter_pass_rate=[0.2,0.8]", "rollout.filter_max_factor=3"]
    config = load_config("configs/quickstart.yaml", band)
    assert dynamic_sampling(config) == DynamicSampling(config.rollout.prompts_per_step, 3.0, (0.2, 0.8))
    assert dynamic_sampling(load_config("configs/quickstart.yaml", [])) is None


def test_the_cap_is_floor_of_factor_times_groups_and_never_below_one_step():
    assert DynamicSampling(4, 1.5).cap == 6  # floor(1.5 x 4)
    assert DynamicSampling(4, 2.9).cap == 11  # floor(11.6)
    assert DynamicSampling(4, 1.0).cap == 4
    assert DynamicSampling(10, 2.3).cap == 23  # 2.3 x 10 is 22.999999999999996 in floating point


def test_a_step_keeps_the_first_informative_groups_and_counts_what_it_judged():
    # P = 2, cap 8: tie, signal, tie, signal -> done after 4 judged; 2 of 4 dropped; 4 judged / 2 trained = 2.
    fill = StepFill(2, 8)
    for gid, rewards in enumerate([[1, 1], [0, 1], [0, 0], [1, 0]]):
        assert not fill.done
        fill.offer(_group(gid, rewards))
    assert fill.done and fill.reclaimed == 0
    groups, m = fill.result()
    assert [g[0].group_id for g in groups] == [1, 3]
    assert m["filter/dropped_frac"] == 0.5 and m["filter/groups_per_trained"] == 2.0 and m["filter/cap_hit"] == 0.0
    assert m["filter/extra_rollout_s"] >= 0.0


def test_a_step_at_its_cap_trains_on_what_it_has_topped_up_with_the_first_dropped_groups():
    # P = 3, cap 5: tie, tie, signal, tie, tie -> cap after 5 judged, 1 informative: the batch is that one and the
    # first 2 ties; 4 of 5 dropped (0.8), 5 judged / 3 trained.
    fill = StepFill(3, 5)
    for gid, rewards in enumerate([[1, 1], [0, 0], [0, 1], [1, 1], [0, 0]]):
        fill.offer(_group(gid, rewards))
    assert fill.done and fill.reclaimed == 2
    groups, m = fill.result()
    assert [g[0].group_id for g in groups] == [2, 0, 1]
    assert m["filter/cap_hit"] == 1.0 and m["filter/dropped_frac"] == 0.8
    assert m["filter/groups_per_trained"] == pytest.approx(5 / 3)


def test_a_surplus_informative_group_of_a_round_is_generated_not_trained():
    fill = StepFill(2, 8)
    for gid in range(3):  # one round of 3 groups, all informative: the third is surplus
        fill.offer(_group(gid, [0, 1]))
    groups, m = fill.result()
    assert [g[0].group_id for g in groups] == [0, 1] and m["filter/groups_per_trained"] == 1.5


def test_a_filtered_group_returns_its_staleness_capacity_and_a_filler_takes_it_back():
    # k = 0, 2 groups per step, version 0: capacity (0 + 0 + 1) x 2 = 2.
    c = StalenessController(max_staleness=0, groups_per_step=2)
    assert [c.try_admit() for _ in range(3)] == [0, 0, None]
    c.release()  # one finished group had no signal: another may start
    assert [c.try_admit() for _ in range(2)] == [0, None]
    c.reclaim(1)  # the step hit its cap and trains that group after all: net 3 > capacity 2, nothing admitted
    c.set_version(1)  # capacity 4: net 3 -> one more
    assert [c.try_admit() for _ in range(2)] == [1, None]


def test_the_tally_compares_generated_trained_and_dropped_groups_by_hand():
    tally = GroupTally()
    tally.add(_group(0, [1, 0, 0, 0], length=2), "trained")  # pass rate 0.25, length 2
    tally.add(_group(1, [1, 1, 0, 0], length=4), "trained")  # 0.5, 4
    tally.add(_group(2, [1, 1, 1, 1], length=9), "dropped")  # 1.0, 9
    m = tally.take()
    assert m["groups/trained_count"] == 2 and m["groups/dropped_count"] == 1 and m["groups/generated_count"] == 3
    assert m["groups/trained_length_mean"] == 3.0 and m["groups/trained_pass_rate"] == 0.375  # (2+4)/2, (.25+.5)/2
    assert m["groups/dropped_length_mean"] == 9.0 and m["groups/dropped_pass_rate"] == 1.0
    assert m["groups/generated_length_mean"] == 5.0 and m["groups/generated_pass_rate"] == pytest.approx(1.75 / 3)
    # the next step starts afresh; a kind without groups has its count alone
    tally.add(_group(3, [0, 1]), "trained")
    assert tally.take() == {"groups/trained_count": 1.0, "groups/trained_length_mean": 2.0,
                            "groups/trained_pass_rate": 0.5, "groups/dropped_count": 0.0,
                            "groups/generated_count": 1.0, "groups/generated_length_mean": 2.0,
                            "groups/generated_pass_rate": 0.5}


def test_a_step_records_what_it_trained_and_what_it_left_out():
    fill = StepFill(2, 4)  # tie, signal, signal (surplus would be the third), tie: done at the second signal
    for gid, rewards in enumerate([[1, 1], [0, 1], [1, 0]]):
        fill.offer(_group(gid, rewards))
    tally = GroupTally()
    fill.record(tally)
    assert [g[0].group_id for g in tally.groups["trained"]] == [1, 2]
    assert [g[0].group_id for g in tally.groups["dropped"]] == [0]


@pytest.mark.parametrize(("override", "named"), [
    ("rollout.filter=sometimes", "rollout.filter"),
    ("rollout.filter_max_factor=0.5", "rollout.filter_max_factor"),
    ("rollout.filter_pass_rate=[0.9,0.8]", "rollout.filter_pass_rate"),  # low above high
    ("rollout.filter_pass_rate=[0.2,0.8]", "rollout.filter_pass_rate"),  # a band with the filter off
])
def test_a_bad_filter_key_is_one_line_naming_it(override, named):
    proc = vcpo("train", "-c", "configs/quickstart.yaml", override, check=False)
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and named in lines[0], proc.stderr


def test_a_filter_on_groups_of_one_is_refused_naming_both_keys():
    proc = vcpo("train", "-c", "configs/quickstart.yaml", "rollout.filter=zero_variance", "rollout.group_size=1",
                check=False)
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert "rollout.filter" in lines[0] and "rollout.group_size" in lines[0]


def trained_groups(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "trained_groups.jsonl").read_text().splitlines()]


def check_filtered_run(run: Path, steps: int, k: int) -> list[dict]:
    """What every filtered run must show: per step P groups, zero-variance ones only at the cap, the filter's
    metrics, and trained_groups.jsonl naming P distinct prompts per step, never reused, generated within k."""
    lines = metrics(run)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    for m in lines:
        assert m["batch/groups"] == 4
        assert {"filter/dropped_frac", "filter/groups_per_trained", "filter/extra_rollout_s"} <= m.keys()
        assert m["reward/zero_var_group_frac"] == 0.0 or m["filter/cap_hit"] == 1.0, m
        assert m["filter/groups_per_trained"] >= 1.0 and m["staleness/max"] <= k
        # groups/*: the trained ones are the batch (equal-size groups: the mean of group means is the batch mean);
        # every judged group was trained or dropped
        assert m["groups/trained_count"] == 4
        assert m["groups/trained_length_mean"] == pytest.approx(m["response/length_mean"])
        assert m["groups/trained_pass_rate"] == pytest.approx(m["reward/mean"])
        assert m["groups/generated_count"] == m["groups/trained_count"] + m["groups/dropped_count"]
        assert m["groups/generated_count"] >= 4 * m["filter/groups_per_trained"] - 1e-9  # + stale drops (async)
    assert any(m["filter/groups_per_trained"] > 1 for m in lines)  # the tiny warm start ties often: refills ran
    records = trained_groups(run)
    assert [r["step"] for r in records] == [s for s in range(1, steps + 1) for _ in range(4)]
    indices = [r["prompt_index"] for r in records]
    assert len(set(indices)) == len(indices)
    for r in records:
        assert set(r) == {"step", "prompt_index", "version", "length_mean"}
        assert 0 <= (r["step"] - 1) - r["version"] <= k and r["length_mean"] > 0
    return lines


def test_sync_filtered_run_trains_only_informative_groups_unless_capped(tmp_path, tiny):
    run = tmp_path / "sync"
    vcpo("train", *tiny, f"run_dir={run}", "async.mode=sync", "async.max_staleness=0", "trainer.max_steps=3",
         *FILTER)
    check_filtered_run(run, 3, 0)


def _without_timing(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not (k.startswith("time/") or k.endswith("_s"))} for m in lines]


@pytest.mark.slow
def test_lagged_filtered_run_is_deterministic_and_resumes_exactly(tmp_path, tiny):
    common = [*tiny, "async.mode=lagged", "async.max_staleness=2", *FILTER]
    full, again, part = tmp_path / "full", tmp_path / "again", tmp_path / "part"
    vcpo("train", *common, f"run_dir={full}", "trainer.max_steps=4")
    vcpo("train", *common, f"run_dir={again}", "trainer.max_steps=4")
    vcpo("train", *common, f"run_dir={part}", "trainer.max_steps=2")
    assert len(trained_groups(part)) == 8
    vcpo("train", "--resume", str(part), "trainer.max_steps=4")
    lines = check_filtered_run(full, 4, 2)
    assert _without_timing(metrics(again)) == _without_timing(lines)  # same seed, same run
    assert _without_timing(metrics(part)) == _without_timing(lines)  # the cursor and queued batches resume exactly
    assert trained_groups(again) == trained_groups(full)
    assert trained_groups(part) == trained_groups(full)  # the resumed run appended steps 3-4, none twice


def test_async_filtered_run_refills_from_the_workers_within_the_bound(tmp_path, tiny):
    run = tmp_path / "async"
    vcpo("train", *tiny, f"run_dir={run}", "async.mode=async", "async.max_staleness=1", "trainer.max_steps=3",
         *FILTER)
    check_filtered_run(run, 3, 1)
