"""Adaptive staleness (``async.max_staleness: auto``): the AIMD policy on hand-worked ESS sequences, the lagged
source and the admission controller under a bound that changes, config errors, the study's adaptive arms, and a
few steps of a real lagged run where k moves (logged as ``staleness/bound``) and resumes exactly."""

from __future__ import annotations

import json

import pytest
import yaml

from vcpo.config import ConfigError, load_config
from vcpo.orchestration import local
from vcpo.orchestration.adaptive_staleness import AdaptiveStaleness, AIMDSettings, adaptive_staleness
from vcpo.orchestration.local import LaggedSource
from vcpo.orchestration.staleness import StalenessController
from vcpo.study.sweep import Cell, run_sweep
from vcpo.types import SamplingParams, Trajectory

from conftest import metrics, vcpo


def settings(**kw) -> AIMDSettings:
    base = {"k_min": 2, "k_max": 20, "k_start": 8, "ess_target": 0.5, "window": 3, "decrease_factor": 0.5,
            "increase_step": 4}
    return AIMDSettings(**(base | kw))


# ---------------------------------------------------------------- the policy, by hand


def test_a_window_of_high_ess_adds_the_step_and_one_below_target_halves():
    c = AdaptiveStaleness(settings())
    # window 1: 0.9, 0.6, 0.45 -> mean 0.65 >= 0.5: k 8 + 4 = 12, decided on the 3rd observation only
    assert [c.observe(x) for x in (0.9, 0.6, 0.45)] == [8, 8, 12]
    # window 2: 0.5, 0.5, 0.4 -> mean 0.4667 < 0.5: k floor(12 * 0.5) = 6
    assert [c.observe(x) for x in (0.5, 0.5, 0.4)] == [12, 12, 6]
    # window 3: 0.3, 0.9, 0.3 -> mean exactly 0.5: at the target counts as high, k 10
    assert [c.observe(x) for x in (0.3, 0.9, 0.3)] == [6, 6, 10]
    assert c.window == []


def test_the_bounds_hold_and_decreases_round_down():
    c = AdaptiveStaleness(settings(k_start=5, decrease_factor=0.7))
    ks = [c.observe(0.1) for _ in range(9)]  # three low windows: 5 -> floor(3.5) = 3 -> floor(2.1) = 2 -> 2 (k_min)
    assert ks[2::3] == [3, 2, 2]
    c = AdaptiveStaleness(settings(k_start=18))
    assert [c.observe(1.0) for _ in range(6)][2::3] == [20, 20]  # 18 + 4 capped at k_max 20


def test_lower_is_the_rules_decrease_and_empties_the_window():  # what on_alarm=rollback applies
    c = AdaptiveStaleness(settings(k_start=9))
    c.observe(0.9)
    assert c.lower() == 4 and c.window == []  # floor(9 * 0.5) = 4, the half-filled window dropped
    assert c.lower() == 2 and c.lower() == 2  # floor(4 * 0.5) = 2 = k_min, then held there


def test_non_finite_or_missing_ess_is_not_observed():
    c = AdaptiveStaleness(settings())
    for x in (float("nan"), None, float("inf"), 0.9, 0.9):
        assert c.observe(x) == 8
    assert c.window == [0.9, 0.9]
    assert c.observe(0.9) == 12


def test_state_round_trips_through_json_and_continues_identically():
    a = AdaptiveStaleness(settings())
    seq = [0.9, 0.2, 0.3, 0.8, 0.7, 0.9, 0.1, 0.6]
    for x in seq[:4]:
        a.observe(x)
    b = AdaptiveStaleness.from_state(settings(), json.loads(json.dumps(a.state())))
    assert b.state() == a.state() == {"k": 4, "window": [0.8]}  # (0.9 + 0.2 + 0.3) / 3 < 0.5: 8 -> 4
    assert [a.observe(x) for x in seq[4:]] == [b.observe(x) for x in seq[4:]] == [4, 8, 8, 8]
    assert AdaptiveStaleness.from_state(settings(), None).k == 8


@pytest.mark.parametrize("kw", [{"k_min": 5, "k_max": 5, "k_start": 5}, {"k_start": 1}, {"window": 0},
                                {"decrease_factor": 1.0}, {"increase_step": 0}, {"ess_target": 0.0}])
def test_settings_refuse_what_the_rule_cannot_use(kw):
    with pytest.raises(ValueError, match="need"):
        settings(**kw)


# ---------------------------------------------------------------- config


def test_auto_config_and_its_controller():
    cfg = load_config(None, ["async.mode=lagged", "async.max_staleness=auto", "async.auto.k_min=2",
                             "async.auto.k_max=32"])
    assert cfg.async_.is_auto and cfg.async_.initial_staleness() == 2 and cfg.async_.generation_bound() == 2
    assert adaptive_staleness(cfg.async_).k == 2
    assert adaptive_staleness(cfg.async_, {"k": 9, "window": [0.5]}).state() == {"k": 9, "window": [0.5]}
    fixed = load_config(None, ["async.max_staleness=3"]).async_
    assert adaptive_staleness(fixed) is None and fixed.initial_staleness() == fixed.generation_bound() == 3
    assert load_config(None, ["async.max_staleness='5'"]).async_.max_staleness == 5


@pytest.mark.parametrize(("overrides", "named"), [
    (["async.max_staleness=often"], "'async.max_staleness': must be an integer >= 0 or auto"),
    (["async.max_staleness=-1"], "'async.max_staleness': must be an integer >= 0 or auto"),
    (["async.mode=sync"], "async.max_staleness=auto needs async.mode=lagged or async"),
    (["async.auto.k_min=8", "async.auto.k_max=8"], "async.auto.k_max=8 must be above async.auto.k_min=8"),
    (["async.auto.k_start=100"], "async.auto.k_start=100 must lie within"),
    (["async.auto.ess_target=1.5"], "'async.auto.ess_target'"),
    (["async.auto.window=0"], "'async.auto.window'"),
    (["async.auto.decrease_factor=1"], "'async.auto.decrease_factor'"),
    (["async.replay.enabled=true", "async.replay.generation_lag=2"], "generation_lag=2 exceeds async.auto.k_min=1"),
    (["async.replay.enabled=true", "async.mode=lagged"], "generation_lag must be below async.auto.k_min=1"),
])
def test_auto_config_errors_name_the_key(overrides, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.").replace("(", r"\(").replace("[", r"\[")):
        load_config(None, ["async.max_staleness=auto", *overrides])


# ---------------------------------------------------------------- sources under a moving bound


def test_lagged_source_follows_the_bound_and_never_exceeds_it(monkeypatch):
    """A fake engine tags every batch with the version it was made at; the lag of each trained batch is checked
    against the k in force, and lowering k drops the queued batches that would exceed it."""
    made: list[tuple[int, int]] = []

    def fake_batch(engine, ctx, index):
        made.append((index, engine.version))
        return [Trajectory("p", index, [1], [2], [-0.1], [engine.version], 0.0, True, SamplingParams())]

    class Engine:
        version = 0

    monkeypatch.setattr(local, "_generate_batch", fake_batch)
    src = LaggedSource(Engine(), None, max_staleness=4)
    schedule = {3: 6, 10: 2, 14: 5}  # version: the k set before it is published
    k, lags = 4, []
    for v in range(18):
        batch = src.next_batch(v)
        lags.append(v - batch[0].versions[0])
        assert lags[-1] <= k
        if v + 1 in schedule:
            k = schedule[v + 1]
            src.set_bound(k)
        src.publish(None, v + 1)
    # k 4 from the start (batches 0..4 made at version 0); 6 from version 3: the four queued lag-4 batches first,
    # then 5, 6 (batches 8, 9 made at version 3); 2 from version 10: the queued batches 10..15 (made at 4..9) lag
    # 6 > 2, all are dropped, batches 10..12 are made at version 10 and the lag restarts at 0; 5 from version 14:
    # the queued lag-2 batches 14, 15 first, then batches 16..19 made at version 14 (lags 2, 3, ...).
    assert lags == [0, 1, 2, 3, 4, 4, 4, 4, 5, 6, 0, 1, 2, 2, 2, 2, 2, 3]
    assert src.metrics()["staleness/dropped_over_bound"] == 6.0
    resumed = LaggedSource(Engine(), None, max_staleness=5)
    resumed.load_state(json.loads(json.dumps(src.state())))
    assert resumed.dropped == 6 and sorted(resumed.pending) == sorted(src.pending)


def test_admission_uses_the_bound_in_force_and_batch_time_drops_beyond_it():
    c = StalenessController(max_staleness=4, groups_per_step=2)
    assert sum(c.try_admit() is not None for _ in range(20)) == 10  # (4 + 0 + 1) x 2
    c.set_bound(1)  # net 10 >= (1 + 0 + 1) x 2: nothing more until the learner is 4 versions further
    c.set_version(3)
    assert c.try_admit() is None
    c.set_version(4)
    assert c.try_admit() == 4
    old = [Trajectory("p", 0, [1], [2], [-0.1], [0], 0.0, True, SamplingParams())]
    assert not c.keep(old, learner_version=4) and c.stats.dropped_over_bound == 1  # lag 4 > 1
    c.set_bound(8)
    assert sum(c.try_admit() is not None for _ in range(30)) == 16  # (8 + 4 + 1) x 2 - (11 - 1)
    with pytest.raises(ValueError):
        c.set_bound(-1)


# ---------------------------------------------------------------- the study's adaptive arms


def test_an_adaptive_arm_runs_one_cell_per_seed_at_its_upper_bound(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"trainer": {"max_steps": 40}}))
    argvs = {}

    def fake(cell: Cell, argv: list[str]) -> tuple[int, str]:
        argvs[cell.name] = argv
        return 1, "not run"

    run_sweep(base, tmp_path / "sw", ["grpo", "m2po_auto"], [0, 16], [0], run_cell=fake, warm_start=False,
              auto_ks=[128])
    assert sorted(argvs) == ["grpo_k0_s0", "grpo_k16_s0", "m2po_auto_k128_s0"]
    auto = argvs["m2po_auto_k128_s0"]
    assert "async.max_staleness=auto" in auto and "async.auto.k_max=128" in auto
    assert not any(a.startswith("async.max_staleness=1") for a in auto)


# ---------------------------------------------------------------- a real lagged run


AUTO = ["async.mode=lagged", "async.max_staleness=auto", "async.auto.k_min=1", "async.auto.k_max=6",
        "async.auto.k_start=4", "async.auto.window=3", "async.auto.increase_step=2", "trainer.max_steps=4"]
"""k 4 for steps 1-3; the decision after step 3 makes it 2 (mean ESS < 0.4) or 6 for step 4. The checkpoint at
step 2 holds a window of two ratios, which a resumed run must carry on with."""


def test_lagged_auto_moves_k_logs_it_and_resumes_exactly(tmp_path, tiny):
    from test_e2e_cli import assert_resumed_run_matches

    full = tmp_path / "full"
    vcpo("train", *tiny, *AUTO, f"run_dir={full}")
    lines = metrics(full)
    bounds = [m["staleness/bound"] for m in lines]
    assert bounds[:3] == [4, 4, 4] and bounds[3] in (2, 6)
    assert all(m["staleness/max"] <= m["staleness/bound"] for m in lines)
    assert [m["staleness/max"] for m in lines[:3]] == [0, 1, 2]  # batches 0..4 all made at version 0
    summary = json.loads((full / "summary.json").read_text())
    assert summary["max_staleness"] == "auto" and summary["staleness_bound"] in (2, 6)
    assert_resumed_run_matches(full, tmp_path / "part", [*tiny, *AUTO])


def test_async_auto_changes_the_admission_bound_live(tmp_path, tiny):
    # A decision every step: step 1's ESS ratio (lag 0: about 1) moves k from 4 to 6 or 2 for step 2, and so on;
    # whatever the timing, every batch respects the bound it was taken under.
    run = tmp_path / "async"
    vcpo("train", *tiny, f"run_dir={run}", "async.mode=async", "async.max_staleness=auto", "async.auto.k_min=1",
         "async.auto.k_max=6", "async.auto.k_start=4", "async.auto.window=1", "async.auto.ess_target=0.99",
         "async.auto.increase_step=2", "trainer.max_steps=4")
    lines = metrics(run)
    bounds = [m["staleness/bound"] for m in lines]
    assert len(bounds) == 4 and bounds[0] == 4 and bounds[1] in (2, 6)
    assert all(m["staleness/max"] <= m["staleness/bound"] for m in lines)
    assert all("staleness/dropped_over_bound" in m for m in lines)


def test_replay_ages_follow_the_bound_and_a_fixed_generation_lag_stays():
    from vcpo.orchestration.replay import ReplayBuffer, ReplaySource

    class Inner:
        def __init__(self) -> None:
            self.bounds: list[int] = []

        def set_bound(self, k: int) -> None:
            self.bounds.append(k)

    def replay(follows: bool) -> ReplaySource:
        return ReplaySource(Inner(), ReplayBuffer(8, 0.5, 0.0, 2, max_age=4, seed=0), 2, inner_follows_bound=follows)

    following, fixed = replay(True), replay(False)
    following.set_bound(7)
    fixed.set_bound(3)
    assert (following.buffer.max_age, following.inner.bounds) == (7, [7])
    assert (fixed.buffer.max_age, fixed.inner.bounds) == (3, [])
