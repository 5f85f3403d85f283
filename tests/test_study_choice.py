"""vcpo.study.choice: the learning rate each arm gets (picked on k = 0 against the reference rate), the best arm per
k with the others' paired differences, and the "holds everywhere" verdict, on hand-made cells whose late accuracies
(the mean of the last three evaluations) are worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vcpo.study.choice import MIN_PROBE_RUNS, Setting, compare, load_settings, main, render

RUNS = [("w0", 0), ("w0", 1), ("w1", 0)]


def write_cell(root: Path, arm: str, k: int, warm: str, seed: int, late: float) -> None:
    """A finished cell whose last three evaluations average to ``late`` (late - 0.01, late, late + 0.01), after an
    earlier evaluation that the late mean must not read."""
    cell = root / "cells" / f"{arm}_k{k}_{warm}_s{seed}"
    cell.mkdir(parents=True)
    (cell / "config.yaml").write_text(f"seed: {seed}\nasync: {{max_staleness: {k}}}\n")
    evals = [0.0, late - 0.01, late, late + 0.01]
    records = [{"step": 25 * (i + 1), "eval/accuracy": acc} for i, acc in enumerate(evals)]
    records[0]["eval/accuracy_initial"] = 0.3
    (cell / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (cell / "summary.json").write_text(json.dumps({"initial_accuracy": 0.3, "final_accuracy": late + 0.01,
                                                   "wall_time_s": 1.0, "steps": 100}))
    (cell / "cell.json").write_text(json.dumps({"arm": arm, "k": k, "seed": seed,
                                                "warm_start": {"id": warm, "path": "x", "hash": "y"}}))


def setting_dirs(tmp_path: Path) -> Path:
    """Rate 3e-4 (reference): arms a and b at k = 0 and 16. Rate 1e-4: a better at k = 0 by 0.05, 0.06, 0.07
    (mean +0.06), and a's stale cells; b worse at 1e-4 (-0.02 each). Rate 1e-3: a better still by 0.2 but on one
    run only (never picked)."""
    ref, low, high = tmp_path / "lr3e-4", tmp_path / "lr1e-4", tmp_path / "lr1e-3"
    for i, ((warm, seed), bump) in enumerate(zip(RUNS, (0.05, 0.06, 0.07), strict=True)):
        write_cell(ref, "a", 0, warm, seed, 0.50)
        write_cell(ref, "b", 0, warm, seed, 0.45)
        write_cell(ref, "a", 16, warm, seed, 0.30)
        write_cell(ref, "b", 16, warm, seed, 0.60 + bump / 10)
        write_cell(low, "a", 0, warm, seed, 0.50 + bump)
        write_cell(low, "b", 0, warm, seed, 0.53)
        write_cell(low, "a", 16, warm, seed, 0.60 + bump / 10 - 0.05 + i * 0.04)
    write_cell(high, "a", 0, "w0", 0, 0.70)
    spec = {"arms": ["a", "b"], "ks": [0, 16],
            "settings": {"toy": {"reference_rate": "3e-4",
                                 "rates": {"3e-4": ["lr3e-4"], "1e-4": ["lr1e-4::a_*"], "1e-3": ["lr1e-3"]}}}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    return tmp_path / "spec.json"


def test_each_arm_gets_the_rate_its_k0_probe_prefers(tmp_path):
    spec_path = setting_dirs(tmp_path)
    (setting,) = load_settings(json.loads(spec_path.read_text()), tmp_path)
    rate, diffs = setting.pick_rate("a")
    assert rate == "1e-4"  # +0.06 on 3 runs; 1e-3's +0.20 is on one run (< MIN_PROBE_RUNS), shown but not picked
    assert diffs["1e-4"].mean == pytest.approx(0.06) and diffs["1e-4"].n == 3
    assert diffs["1e-3"].n == 1 < MIN_PROBE_RUNS and diffs["1e-3"].mean == pytest.approx(0.20)
    # b's 1e-4 cells are left out by the glob "a_*": b has the reference rate only
    assert setting.pick_rate("b") == ("3e-4", {})
    assert setting.pick_rate("missing") == (None, {})


def test_a_rate_worse_than_the_reference_is_not_picked():
    setting = Setting("toy", "3e-4", {"3e-4": {("a", 0): {r: 0.5 for r in RUNS}},
                                      "1e-4": {("a", 0): {r: 0.45 + i * 0.01 for i, r in enumerate(RUNS)}}})
    rate, diffs = setting.pick_rate("a")
    assert rate == "3e-4" and diffs["1e-4"].mean == pytest.approx(-0.04)


def test_the_best_arm_per_k_is_read_at_each_arms_own_rate(tmp_path):
    (setting,) = load_settings(json.loads(setting_dirs(tmp_path).read_text()), tmp_path)
    at0 = compare(setting, ["a", "b"], 0)
    # a at 1e-4: 0.55, 0.56, 0.57 beats b at 3e-4 (0.45): b - a = -0.10, -0.11, -0.12, mean -0.11 +- 4.303 * 0.01
    # / sqrt(3) = 0.025: below
    assert at0.best == "a"
    d = at0.to_best["b"]
    assert d.mean == pytest.approx(-0.11) and d.high == pytest.approx(-0.11 + 4.303 * 0.01 / 3**0.5)
    assert at0.verdict("b") == "below" and at0.verdict("a") == "best"
    at16 = compare(setting, ["a", "b"], 16)
    # b at 3e-4: 0.605, 0.606, 0.607; a at 1e-4: 0.555, 0.596, 0.637 (mean 0.596): a - b = -0.05, -0.01, +0.03
    assert at16.best == "b"
    d = at16.to_best["a"]
    assert d.mean == pytest.approx(-0.01) and d.n == 3 and d.low < 0 < d.high and at16.verdict("a") == "within"


def test_the_best_arm_is_ranked_over_the_runs_all_arms_have():
    # a's third run is easy (0.9): over its own runs a averages 0.6667 > b's 0.56, but on the two runs both have
    # b (0.55, 0.57) beats a (0.55, 0.55)
    setting = Setting("toy", "3e-4", {"3e-4": {("a", 0): dict(zip(RUNS, (0.55, 0.55, 0.90), strict=True)),
                                               ("b", 0): dict(zip(RUNS[:2], (0.55, 0.57), strict=True))}})
    comparison = compare(setting, ["a", "b"], 0)
    assert comparison.best == "b" and comparison.to_best["a"].mean == pytest.approx(-0.01)


def test_one_common_run_tells_nothing():
    setting = Setting("toy", "3e-4", {"3e-4": {("a", 0): {RUNS[0]: 0.5}, ("b", 0): {RUNS[0]: 0.6}}})
    comparison = compare(setting, ["a", "b"], 0)
    assert comparison.verdict("a") == "unknown"
    text = render([setting], ["a", "b"], [0])
    assert "a -0.100 (1) (unknown)" in text and "- a: yes (too few runs to tell at toy k = 0)" in text
    alone = Setting("toy", "3e-4", {"3e-4": {("a", 16): {RUNS[0]: 0.5}, ("a", 0): {RUNS[0]: 0.5}}})
    assert "- k = 16: best **a** (the only arm run at its rate)" in render([alone], ["a", "b"], [16])


def test_the_table_names_the_picked_rate_and_who_holds_everywhere(tmp_path, capsys):
    spec_path = setting_dirs(tmp_path)
    (setting,) = load_settings(json.loads(spec_path.read_text()), tmp_path)
    text = render([setting], ["a", "b"], [0, 16])
    assert "| a | **1e-4** (1e-4: +0.060" in text and "1e-3: +0.200 (1)" in text
    assert "| b | **3e-4** (one rate tried) | 0.450 [0.450, 0.450] (3) |" in text
    # a is within noise of b at k = 16 on a - b = -0.05, -0.01, +0.03: sd 0.04, half-width 4.303 * 0.04 / sqrt(3)
    # = 0.0994, so the interval still allows a loss of 0.01 + 0.0994 = 0.109
    assert "- a: yes; within noise allows a loss of up to 0.109 (toy k = 16)" in text
    assert "- b: no, below at toy k = 0\n" in text
    main([str(spec_path)])
    assert capsys.readouterr().out == text


def test_a_bad_spec_is_one_line_naming_it(tmp_path):
    spec_path = setting_dirs(tmp_path)
    spec = json.loads(spec_path.read_text())
    spec["settings"]["toy"]["rates"]["3e-4"] = ["nowhere"]
    spec_path.write_text(json.dumps(spec))
    with pytest.raises(SystemExit, match=r"spec\.json: .*nowhere: no such cell directory"):
        main([str(spec_path)])
