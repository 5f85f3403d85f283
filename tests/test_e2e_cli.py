"""End to end through the real command line: a few steps of each mode on a tiny warm start.

Checks the metric keys of API.md §3, the staleness bound, exact resume in lagged mode, and that a
bad config key or value exits non-zero with one line naming it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import LAGGED, ROOT, metrics, vcpo

REQUIRED_KEYS = {"step", "reward/mean", "ess/ratio", "grad_norm", "lr", "staleness/max", "staleness/mean",
                 "time/step_s"}


@pytest.mark.parametrize(("mode", "k", "extra"), [
    ("sync", 0, []),
    ("lagged", 2, ["objective.name=tis", "objective.kwargs.level=sequence", "advantage.estimator=grpo"]),
    ("async", 1, ["async.inflight_updates=true", "objective.name=vespo", "advantage.estimator=rloo"]),
])
def test_each_mode_runs_and_logs_the_contract_keys(tmp_path, tiny, mode, k, extra):
    run = tmp_path / mode
    vcpo("train", *tiny, f"run_dir={run}", f"async.mode={mode}",
         f"async.max_staleness={k}", "trainer.max_steps=4", *extra)
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    for m in lines:
        assert REQUIRED_KEYS <= m.keys()
        assert m["staleness/max"] <= k
        assert m["reward/errors"] == 0 and m["reward/timeouts"] == 0  # counted in every mode, async included
    assert {2, 4} <= {m["step"] for m in lines if "eval/accuracy" in m}
    if mode == "lagged":  # batch t comes from the weights of step t - k exactly
        assert [m["staleness/max"] for m in lines] == [0, 1, 2, 2]
    assert (run / "config.yaml").is_file() and (run / "summary.json").is_file()
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "config.json").is_file()


def assert_resumed_run_matches(full: Path, part: Path, common: list[str]) -> list[dict]:
    """Run 2 steps into ``part`` and resume to 4: every non-timing metric must equal the 4-step run ``full``'s."""
    # Stop at step 2 (an evaluation step anyway, so both runs log the same keys), resume to 4.
    vcpo("train", *common, f"run_dir={part}", "trainer.max_steps=2")
    vcpo("train", "--resume", str(part), "trainer.max_steps=4")
    a, b = metrics(full), metrics(part)
    assert [m["step"] for m in b] == [1, 2, 3, 4]  # no step lost or repeated
    for ma, mb in zip(a, b, strict=True):
        ka = {k: v for k, v in ma.items() if not k.startswith("time/")}
        kb = {k: v for k, v in mb.items() if not k.startswith("time/")}
        assert ka == kb, f"step {ma['step']} differs after resume"
    return a


def trained_groups(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "trained_groups.jsonl").read_text().splitlines()]


def test_lagged_resume_equals_uninterrupted_run(tmp_path, tiny, lagged_full):
    assert_resumed_run_matches(lagged_full, tmp_path / "part", [*tiny, *LAGGED])
    # trained_groups.jsonl: step t trains batch t - 1 of the stream (4 groups: prompts 4(t-1)..4t-1), generated at
    # version max(0, t - 1 - k); the resumed run appended steps 3-4 to what steps 1-2 wrote
    full = trained_groups(lagged_full)
    assert [(r["step"], r["prompt_index"], r["version"]) for r in full] == [
        (t, 4 * (t - 1) + i, max(0, t - 3)) for t in range(1, 5) for i in range(4)]
    assert all(r["length_mean"] > 0 for r in full)
    assert trained_groups(tmp_path / "part") == full


@pytest.mark.slow
def test_lagged_replay_resumes_exactly_with_tb(tmp_path, tiny):
    # Fresh batches at lag 1, replayed groups up to k = 2; the buffer and its RNG are in the checkpoint.
    common = [*tiny, *LAGGED, "async.replay.enabled=true", "async.replay.generation_lag=1",
              "async.replay.groups_per_step=6", "async.replay.max_uses=2", "objective.name=tb",
              "advantage.estimator=grpo", "trainer.ess_lr.enabled=false"]
    vcpo("train", *common, f"run_dir={tmp_path / 'full'}")
    lines = assert_resumed_run_matches(tmp_path / "full", tmp_path / "part", common)
    assert [m["staleness/max"] for m in lines] == [0, 1, 2, 2]
    assert max(m["replay/age_max"] for m in lines) == 2 and all(m["replay/max_age"] == 2 for m in lines)
    assert any(m["replay/uses_max"] == 2 for m in lines) and all(m["replay/fresh_groups"] == 4 for m in lines)


@pytest.mark.slow
def test_tba_recipe_runs_with_searchers_and_stops_at_its_time_budget(tmp_path, tiny, tiny_overrides):
    # configs/tba.yaml as shipped (async, tb, replay), with two searchers to spare the CI machine.
    run = tmp_path / "tba"
    vcpo("train", "-c", "configs/tba.yaml", *tiny_overrides, f"run_dir={run}", "trainer.max_steps=3",
         "async.num_workers=2")
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        assert REQUIRED_KEYS <= m.keys() and m["staleness/max"] <= 4 and m["replay/age_max"] <= 4
        assert m["batch/size"] == 4 * 4 and m["replay/fresh_groups"] == 4  # 4 groups of 4 drawn, 4 arrived
    # A wall-clock budget of 1 ms ends the run after its first step, evaluated as a last step is.
    budget = tmp_path / "budget"
    vcpo("train", *tiny, f"run_dir={budget}", "async.mode=sync",
         "trainer.max_steps=50", "trainer.max_time_s=0.001")
    assert [(m["step"], "eval/accuracy" in m) for m in metrics(budget)] == [(1, True)]
    assert json.loads((budget / "summary.json").read_text())["steps"] == 1


@pytest.mark.parametrize(("override", "named"), [
    ("trainer.lrr=0.1", "trainer.lrr"),
    ("async.mode=sometimes", "async.mode"),
    ("objective.name=ppo", "objective.name"),
    ("trainer.lr=-1", "trainer.lr"),
    ("objective.kwargs.capp=3", "capp"),
])
def test_bad_config_exits_nonzero_with_one_line_naming_it(override, named):
    proc = vcpo("train", "-c", "configs/quickstart.yaml", override, check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and named in lines[0], proc.stderr


def test_fresh_run_refuses_a_directory_holding_another_run(tmp_path, tiny):
    run = tmp_path / "run"
    args = ["train", *tiny, f"run_dir={run}", "async.mode=sync", "trainer.max_steps=2"]
    vcpo(*args)
    proc = vcpo(*args, check=False)
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and "--resume" in lines[0], proc.stderr
    assert len(metrics(run)) == 2  # the finished run is untouched


def test_missing_model_path_is_one_clear_error(tmp_path):
    # A fresh run_dir: the checkout may hold a finished demo run in the config's default one.
    proc = vcpo("train", "-c", "configs/quickstart.yaml", f"model.path={tmp_path / 'nope'}",
                f"run_dir={tmp_path / 'run'}", check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "nope" in lines[0], proc.stderr


def test_eval_of_a_run_uses_its_config_and_writes_next_to_the_model(tmp_path, lagged_full):
    """`vcpo eval RUN` (its latest checkpoint) or `vcpo eval CHECKPOINT`: the run's own config.yaml, so its
    task.eval_size (16 in the tiny runs), not the built-in 500; eval.json lands in the directory named, never in the
    current one (issue 23 items 6 and 7)."""
    run = Path(shutil.copytree(lagged_full, tmp_path / "run"))
    in_cwd = ROOT / "eval.json"
    existed = in_cwd.exists()
    proc = vcpo("eval", str(run), "--samples", "0")
    assert "the run's own" in proc.stderr and str(run / "config.yaml") in proc.stderr
    report = json.loads((run / "eval.json").read_text())
    assert report["model"] == str(run / "checkpoints" / "step_000004")
    assert report["datasets"]["chain_sum"]["problems"] == 16
    ckpt = run / "checkpoints" / "step_000002"
    vcpo("eval", str(ckpt), "--samples", "0", "task.eval_size=5")  # overrides apply on top of the run's config
    assert json.loads((ckpt / "eval.json").read_text())["datasets"]["chain_sum"]["problems"] == 5
    out = tmp_path / "elsewhere" / "report.json"
    vcpo("eval", str(ckpt), "--samples", "0", "--out", str(out))
    assert out.is_file() and in_cwd.exists() == existed
