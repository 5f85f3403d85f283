"""Early-warning rules on hand-made metric streams, their tuning, and the tuning/held-out split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vcpo.study.detector import BASELINE_RULES, ESS_ALARM, GRAD_RULES, Rule, detector_split, preference, score, tune

ROOT = Path(__file__).resolve().parents[1]


def _records(ess, reward):
    return [{"step": i + 1, "ess/ratio": e, "reward/mean": r} for i, (e, r) in enumerate(zip(ess, reward, strict=True))]


def test_ess_rule_warns_on_the_smoothed_level_after_warmup():
    rule = Rule(smooth=2, ess_below=0.3, warmup=3)
    # 2-step means of steps 2..6: 0.9, 0.55, 0.2, 0.2, 0.6 -> below 0.3 at steps 4 and 5 only
    records = _records([0.9, 0.9, 0.2, 0.2, 0.2, 1.0], [0.5] * 6)
    assert rule.warning_steps(records) == [4, 5]
    assert Rule(smooth=2, ess_below=0.3, warmup=5).warning_steps(records) == [5]


def test_reward_rule_warns_on_a_fall_from_the_best_smoothed_reward():
    rule = Rule(smooth=2, reward_drop=0.5, warmup=1)
    # 2-step means: step 2: 0.4, step 3: 0.5 (best), step 4: 0.3 (>= 0.25), step 5: 0.15 < 0.5 x 0.5 -> warn;
    # step 6: 0.1 < 0.25 -> warn
    records = _records([1.0] * 6, [0.4, 0.4, 0.6, 0.0, 0.3, -0.1])
    assert rule.warning_steps(records) == [5, 6]
    both = Rule(smooth=2, reward_drop=0.5, ess_below=0.5, warmup=1)  # the fall alone is not enough
    assert both.warning_steps(records) == []
    assert "reward's 2-step mean < 0.5 x its best" in rule.describe()


def _cell(collapse_step, ess_low_from=None, warm_start="w0", seed=0):
    ess = [0.1 if ess_low_from is not None and s >= ess_low_from else 0.9 for s in range(1, 101)]
    return {"collapse_step": collapse_step, "records": _records(ess, [0.5] * 100), "warm_start": warm_start,
            "seed": seed}


def test_score_counts_hits_false_alarms_and_alarms_per_stable_run():
    rule = Rule(smooth=1, ess_below=0.3, warmup=1)
    cells = [_cell(60, ess_low_from=40),  # warned from 40: lead 20
             _cell(60),  # never warned: a miss
             _cell(None, ess_low_from=90),  # a false alarm, one episode
             _cell(None)]  # quiet
    result = score(rule, cells)
    assert (result["collapsed"], result["hits"], result["misses"]) == (2, 1, 1)
    assert (result["false_alarms"], result["quiet"], result["lead_steps"]) == (1, 1, [20])
    assert result["alarms_per_stable_run"] == pytest.approx(0.5)  # 1 episode + 0 over two stable runs


def test_tune_prefers_recall_within_the_false_alarm_goal():
    cells = [_cell(80, ess_low_from=30)] + [_cell(None, ess_low_from=None) for _ in range(9)]
    rules = [Rule(smooth=1, ess_below=0.05, warmup=1), Rule(smooth=1, ess_below=0.5, warmup=1)]
    rule, result = tune(rules, cells)
    assert rule == rules[1] and result["recall"] == 1.0 and result["false_alarm_rate"] == 0.0
    assert tune(rules, [_cell(None)]) is None  # nothing collapsed: nothing to tune on
    # within the goal beats more recall outside it
    assert preference({"recall": 0.5, "false_alarm_rate": 0.1, "median_lead_steps": 1}) > preference(
        {"recall": 1.0, "false_alarm_rate": 0.5, "median_lead_steps": 50})


def test_split_by_warm_start_then_by_seed():
    cells = [_cell(None, warm_start=w, seed=s) for w in ("w1", "w0") for s in (0, 1)]
    tuning, held_out, how = detector_split(cells)
    assert {c["warm_start"] for c in tuning} == {"w0"} and {c["warm_start"] for c in held_out} == {"w1"}
    assert how == "tuned on warm start w0, held out: warm starts w1" and len(tuning) == len(held_out) == 2
    legacy = [_cell(None, warm_start=None, seed=s) for s in (1, 0, 2)]  # issue 5's cells: no warm-start id
    tuning, held_out, how = detector_split(legacy)
    assert [c["seed"] for c in tuning] == [0] and sorted(c["seed"] for c in held_out) == [1, 2]
    assert detector_split([_cell(None, seed=0)]) is None
    # the first warm start without a collapse: tune on the first one that has one
    cells = [_cell(None, warm_start="w0"), _cell(50, warm_start="w1"), _cell(None, warm_start="w2")]
    tuning, held_out, how = detector_split(cells)
    assert [c["warm_start"] for c in tuning] == ["w1"] and [c["warm_start"] for c in held_out] == ["w0", "w2"]
    assert how == "tuned on warm start w1 (warm start w0 had no collapse to tune on), held out: warm starts w0, w2"


def test_the_trivial_baseline_family_is_the_ess_level_alone():
    assert all(r.reward_drop is None and r.ess_below is not None for r in BASELINE_RULES)


def test_the_gradient_gate_and_the_online_state():
    rule = Rule(smooth=2, ess_below=0.3, grad_below=1.0, grad_smooth=2, warmup=1)
    records = [{"step": i + 1, "ess/ratio": 0.1, "reward/mean": 0.5, "grad_norm": g}
               for i, g in enumerate([2.0, 2.0, 0.5, None, 0.5, 2.0])]
    # 2-step means of the last finite norms at steps 2-6: 2.0, 1.25, 1.25 (step 4's missing norm is passed over),
    # 0.5, 1.25
    assert rule.warning_steps(records) == [5]
    assert "gradient norm's 2-step mean < 1" in rule.describe()
    first = rule.tracker()
    for record in records[:3]:
        first.update(record)
    resumed = rule.tracker(json.loads(json.dumps(first.state())))  # through a checkpoint's JSON
    assert [resumed.update(r) for r in records[3:]] == [False, True, False]


def test_the_trainer_s_ess_alarm_on_the_committed_study2_cells():
    """ESS_ALARM is what `vcpo report` tunes from GRAD_RULES on study2 (+ its issue-24 arms); its scores on the
    committed cells, against the trivial rule the report picks (tuning: warm start w0, held out: w1)."""
    from vcpo.study.report import load_cells

    assert ESS_ALARM in GRAD_RULES
    cells = [c for name in ("study2", "study2_issue24") for c in load_cells(ROOT / "benchmarks/staleness" / name)[0]]
    tuning, held_out, _ = detector_split(cells)
    scores = {name: (score(rule, tuning), score(rule, held_out)) for name, rule in (
        ("gated", ESS_ALARM), ("trivial", Rule(smooth=10, ess_below=0.2, warmup=20)))}
    counts = {name: [(s["hits"], s["collapsed"], s["false_alarms"], s["false_alarms"] + s["quiet"]) for s in pair]
              for name, pair in scores.items()}
    assert counts == {"gated": [(2, 2, 4, 144), (5, 5, 10, 139)], "trivial": [(2, 2, 8, 144), (5, 5, 24, 139)]}
