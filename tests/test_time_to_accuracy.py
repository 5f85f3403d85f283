"""benchmarks/time_to_accuracy.py's arithmetic: where a curve first reaches the target, synchronous GRPO's late
accuracy read from committed study cells, and the model and its check."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import time_to_accuracy as tta

STUDY3 = tta.Study(ROOT / "benchmarks/staleness/study3/cells", "w0")


def test_a_crossing_is_interpolated_between_evaluations_and_never_when_missed():
    assert tta.crossing([(0, 0.6), (10, 0.7), (20, 0.9)], 0.8) == pytest.approx(15.0)
    assert tta.crossing([(0, 0.5), (10, 0.85), (20, 0.7)], 0.8) == pytest.approx(10 * 0.3 / 0.35)
    assert tta.crossing([(0, 0.6), (10, 0.5)], 0.6) == 0  # already there before RL
    assert tta.crossing([(0, 0.6), (10, 0.7), (20, 0.79)], 0.8) is None


def test_the_target_is_the_mean_of_sync_grpos_last_three_evaluations():
    for seed in (0, 1, 2):
        text = (STUDY3.cells / f"grpo_k0_w0_s{seed}/metrics.jsonl").read_text()
        lines = [json.loads(line) for line in text.splitlines()]
        evals = [m["eval/accuracy"] for m in lines if "eval/accuracy" in m]
        assert len(evals) == 4 and tta.sync_target(STUDY3, seed) == pytest.approx(sum(evals[-3:]) / 3)
    assert tta.study_cells(tta.Study(STUDY3.cells, "w9"), "grpo", 0) == {}  # another warm start's cells only
    steps = tta.lagged(STUDY3, "grpo", 0)
    assert sorted(steps) == [0, 1, 2] and all(s is not None and 0 < s <= 40 for s in steps.values())


def test_the_model_is_lagged_steps_times_measured_step_time_checked_at_the_staleness_seen():
    runs = {0: {"step_s_mean": 2.0, "seconds_to_target": 30.0, "staleness_mean": 1.0, "staleness_max": 3,
                "ess_ratio_mean": 0.9},
            1: {"step_s_mean": 4.0, "seconds_to_target": None, "staleness_mean": 2.0, "staleness_max": 5,
                "ess_ratio_mean": 0.7}}
    row = tta.summarize(STUDY3, "vespo", 16, runs)
    k4, k16 = tta.lagged(STUDY3, "vespo", 4), tta.lagged(STUDY3, "vespo", 16)
    assert tta.study_ks(STUDY3, "vespo") == [0, 4, 16, 64] and sorted(row["model_seconds"]) == [0, 4, 16, 64]
    assert row["checks"][0] == {"k_seen": 4, "real_s": 30.0, "model_s": pytest.approx(k4[0] * 2.0)}  # 3 -> k = 4
    assert row["checks"][1] == {"k_seen": 16, "real_s": None, "model_s": pytest.approx(k16[1] * 4.0)}  # 5 -> 16
    reached = [v for v in k16.values() if v is not None]
    assert row["model_seconds"][16] == pytest.approx(sum(reached) / len(reached) * 3.0)  # mean step time 3 s
    assert (row["real_reached"], row["staleness_max"], row["real_seconds_mean"]) == (1, 5, 30.0)
    line = tta.measured_table([row]).splitlines()[-1]
    assert f"s0 k4: {k4[0] * 2.0:.0f} / 30 ({k4[0] * 2.0 / 30:.2f})" in line and "30 (1/2)" in line
    ratio = k4[0] * 2.0 / 30
    assert tta.check_summary([row]) == (f"check: model / real seconds over 1 runs: median {ratio:.2f}, range "
                                        f"{ratio:.2f}-{ratio:.2f}, {int(2 / 3 <= ratio <= 1.5)} of 1 within 1.5x; "
                                        "1 run(s) reach the target on one side only")
