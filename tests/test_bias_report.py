"""The bias figures of a run (vcpo.study.bias) and `vcpo report RUN_DIR`, on a metrics file written here: generated,
trained and dropped groups' length and pass rate, and trained - generated with an interval over steps."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from vcpo.cli import app
from vcpo.study.bias import bias_figures, bias_lines, group_counts, sweep_bias_lines


def _step(step: int, trained: tuple[int, float, float], dropped: tuple[int, float, float]) -> dict:
    """A metrics line with a step's groups/*: (count, length_mean, pass_rate) of the trained and dropped groups, and
    the generated ones as the tally computes them (both together, each group weighing one prompt)."""
    (nt, lt, pt), (nd, ld, pd) = trained, dropped
    n = nt + nd
    out = {"step": step, "reward/mean": 0.5, "groups/trained_count": float(nt), "groups/dropped_count": float(nd),
           "groups/generated_count": float(n), "groups/trained_length_mean": lt, "groups/trained_pass_rate": pt,
           "groups/generated_length_mean": (nt * lt + nd * ld) / n,
           "groups/generated_pass_rate": (nt * pt + nd * pd) / n}
    if nd:
        out |= {"groups/dropped_length_mean": ld, "groups/dropped_pass_rate": pd}
    return out


# Step 1: 2 trained of length 20 (pass 0.75) and 2 dropped of 40 (0.25): generated 30, 0.5; trained - generated -10.
# Step 2: 2 of 10 (0.5), 2 of 22 (0.5): generated 16, 0.5; -6.  Step 3: 2 of 12 (0.3), 1 of 36 (0.0): 20, 0.2; -8.
RECORDS = [_step(1, (2, 20.0, 0.75), (2, 40.0, 0.25)), {"step": 2, "eval/accuracy": 0.4} | _step(2, (2, 10.0, 0.5),
           (2, 22.0, 0.5)), _step(3, (2, 12.0, 0.3), (1, 36.0, 0.0))]


def test_levels_are_pooled_over_groups_and_the_difference_has_a_t_interval_over_steps():
    length, passing = bias_figures(RECORDS)
    assert group_counts(RECORDS) == {"generated": 11, "trained": 6, "dropped": 5}
    # generated (4 x 30 + 4 x 16 + 3 x 20) / 11 = 244 / 11; trained (2 x 20 + 2 x 10 + 2 x 12) / 6 = 14;
    # dropped (2 x 40 + 2 x 22 + 1 x 36) / 5 = 32
    assert length.level == pytest.approx({"generated": 244 / 11, "trained": 14.0, "dropped": 32.0})
    # differences -10, -6, -8: mean -8, s = 2, half width t(2) x 2 / sqrt(3) = 4.303 x 1.1547 = 4.969
    d = length.difference
    assert (d.mean, d.low, d.high, d.n) == pytest.approx((-8.0, -12.969, -3.031, 3), abs=1e-3)
    assert d.excludes_zero()
    # pass rate: generated (4 x 0.5 + 4 x 0.5 + 3 x 0.2) / 11 = 4.6 / 11, trained (1.5 + 1 + 0.6) / 6 = 3.1 / 6,
    # dropped (0.5 + 1 + 0) / 5 = 0.3; differences 0.25, 0, 0.1: mean 0.35 / 3, s = 0.1258, half 0.3126
    assert passing.level == pytest.approx({"generated": 4.6 / 11, "trained": 3.1 / 6, "dropped": 0.3})
    assert passing.difference.mean == pytest.approx(0.35 / 3)
    assert not passing.difference.excludes_zero()


def test_a_run_without_drops_trains_what_it_generated():
    records = [_step(s, (4, 10.0 + s, 0.5), (0, 0.0, 0.0)) for s in (1, 2, 3)]
    length, _ = bias_figures(records)
    assert length.level["dropped"] is None and length.level["trained"] == length.level["generated"] == 12.0
    assert (length.difference.mean, length.difference.low, length.difference.high) == (0.0, 0.0, 0.0)
    assert "| mean length (tokens) | 12.000 | 12.000 | - | 0.000 [0.000, 0.000] |" in bias_lines(records)


def test_vcpo_report_prints_a_runs_table_and_names_a_directory_it_cannot_read(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert "Groups: 11 generated, 6 trained, 5 dropped (45.5%)" in result.output
    assert "| mean length (tokens) | 22.182 | 14.000 | 32.000 | -8.000 [-12.969, -3.031] * |" in result.output
    assert "| pass rate | 0.418 | 0.517 | 0.300 | 0.117 [-0.196, 0.429] |" in result.output
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    assert "no bias figures" in CliRunner().invoke(app, ["report", str(run)]).output
    result = CliRunner().invoke(app, ["report", str(tmp_path / "nothing")])
    assert result.exit_code == 2 and "neither a sweep directory" in result.output


def test_a_sweep_gets_one_row_per_arm_and_k_over_its_runs():
    cells = [{"arm": "grpo", "k": 4, "records": RECORDS}, {"arm": "grpo", "k": 4, "records": RECORDS[:2]},
             {"arm": "vcpo", "k": 4, "records": [{"step": 1}]}]
    # run means -8 and -8 (steps 1-2: -10, -6); pass 0.35 / 3 and 0.125
    lines = sweep_bias_lines(cells)
    assert lines[2] == "| grpo | 4 | -8.000 [-8.000, -8.000] | 0.121 [0.068, 0.174] |"
    assert len(lines) == 3 and sweep_bias_lines([cells[2]]) == []
