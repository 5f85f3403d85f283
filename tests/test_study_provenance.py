"""Reproducibility of the staleness study: warm-start hashes and pins, the SFT recipe's fingerprint, the metrics
digest, git state, the sweep's and the report's refusals to mix warm starts, and `vcpo rerun`'s comparison."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from vcpo.models.default import DEFAULT_ARCHITECTURE
from vcpo.study.export import export_sweep, rounded
from vcpo.study.grids import HELDOUT, STUDY2, STUDY4, WarmStartPin
from vcpo.study.provenance import git_state, metrics_digest, warm_start_hash
from vcpo.study.report import ReportError, write_report
from vcpo.study.rerun import compare_metrics
from vcpo.study.sweep import SweepError, run_sweep

from conftest import ROOT, vcpo

STUDY_CONFIG = ROOT / "configs" / "staleness_study.yaml"


def _model_dir(path: Path, weights: bytes = b"w", version: str = "5.0") -> Path:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(weights)
    (path / "config.json").write_text(json.dumps({"hidden_size": 8, "transformers_version": version}))
    (path / "tokenizer.json").write_text('{"vocab": {"a": 0}}')
    return path


def test_warm_start_hash_sees_weights_not_library_versions(tmp_path):
    base = warm_start_hash(_model_dir(tmp_path / "a"))
    assert base == warm_start_hash(_model_dir(tmp_path / "b", version="6.1"))  # re-saved by another release
    assert base != warm_start_hash(_model_dir(tmp_path / "c", weights=b"W"))  # one changed weight byte
    assert len(base) == 16


def test_metrics_digest_ignores_wall_clock_only():
    run = [{"step": 1, "reward/mean": 0.25, "time/step_s": 0.1}, {"step": 2, "reward/mean": 0.5}]
    same_but_slower = [{"step": 1, "reward/mean": 0.25, "time/step_s": 9.9}, {"step": 2, "reward/mean": 0.5}]
    last_bit = [{"step": 1, "reward/mean": 0.25}, {"step": 2, "reward/mean": 0.5000000000000001}]
    assert metrics_digest(run) == metrics_digest(same_but_slower) != metrics_digest(last_bit)


def test_git_state_commit_and_dirty_flag(tmp_path):
    assert git_state(tmp_path) == {"commit": None, "dirty": None}  # not a checkout

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "f.txt").write_text("1")
    git("add", "f.txt")
    git("commit", "-q", "-m", "one")
    state = git_state(tmp_path)
    assert len(state["commit"]) == 40 and state["dirty"] is False
    (tmp_path / "untracked.txt").write_text("x")  # untracked files do not make it dirty
    assert git_state(tmp_path)["dirty"] is False
    (tmp_path / "f.txt").write_text("2")
    assert git_state(tmp_path)["dirty"] is True


DEFAULT_SHAPE = DEFAULT_ARCHITECTURE.model_dump()
LARGE_SHAPE = {"hidden_size": 256, "num_layers": 6, "num_heads": 8, "intermediate_size": 768}


@pytest.mark.parametrize(("grid", "shape", "params"), [(STUDY2, DEFAULT_SHAPE, 439_808),
                                                       (STUDY4, LARGE_SHAPE, 5_141_504),
                                                       (HELDOUT, DEFAULT_SHAPE, 439_808)],
                         ids=["study2", "study4", "heldout"])
def test_committed_warm_starts_match_their_pins_and_the_recipe(grid, shape, params):
    """Each pinned warm start: its hash, its grid's SFT recipe (its base config) with sft.seed = its index, its
    model's shape (study4: 11.7x the default's parameters). study2's predate sft.architecture: their sft.json has no
    such entry."""
    from safetensors.torch import load_file

    config = yaml.safe_load((ROOT / grid.base_config).read_text())
    for i, (ws, pin) in enumerate(grid.warm_starts.items()):
        path = ROOT / pin.path
        assert warm_start_hash(path) == pin.sha, f"{pin.path} changed: a new warm start needs a new pin"
        recipe = json.loads((path / "sft.json").read_text())
        assert recipe["seed"] == i and recipe["task"] == {k: config["task"][k] for k in ("name", "kwargs")}, ws
        assert {k: recipe[k] for k in ("steps", "batch_size", "lr")} == {
            k: config["sft"][k] for k in ("steps", "batch_size", "lr")}
        assert recipe.get("architecture", DEFAULT_SHAPE) == shape
        assert sum(w.numel() for w in load_file(path / "model.safetensors").values()) == params


@pytest.fixture(scope="module")
def tiny_warm_start(tmp_path_factory) -> Path:
    """The study's SFT recipe cut to 3 steps of 8 problems (sft seed 0), pinned by `vcpo sft --save`."""
    tmp = tmp_path_factory.mktemp("warm")
    vcpo("sft", "-c", str(STUDY_CONFIG), "sft.steps=3", "sft.batch_size=8", "task.eval_size=8", "sft.seed=0",
         f"sft.cache_dir={tmp / 'cache'}", "runtime.torch_threads=1", "--save", str(tmp / "w0"))
    return tmp / "w0"


def test_sft_recipe_fingerprint(tiny_warm_start):
    """Fails when a code change would silently change the warm start: the study's task, tokenizer, model
    initialisation and SFT loop, run for 3 steps of 8 problems. Text is compared exactly, floats to 1e-4
    relative (other CPUs' kernels round differently in the last bits)."""
    from safetensors.torch import load_file

    from vcpo.config import load_config
    from vcpo.tasks import make_task

    # The first SFT problems of seed 0 (6 + 1 + 0 = 7, 5 - 5 - 8 = -8, ...)
    task = make_task(load_config(STUDY_CONFIG).task)
    first = [(p.prompt, p.answer) for p in task.problems("train", 4, 0)]
    assert first == [("6 + 1 + 0 = ", "7"), ("5 - 5 - 8 = ", "-8"), ("1 - 9 + 9 = ", "1"), ("3 - 9 + 6 = ", "0")]
    vocab = json.loads((tiny_warm_start / "tokenizer.json").read_text())["model"]["vocab"]
    # 3 special tokens, then the 100 printable characters sorted: \t \n \x0b \x0c \r (3-7), " " (8), "!" ... "/"
    # (9-23, so "+" is 9 + 10 = 19), "0" (24)
    assert len(vocab) == 103 and [vocab[t] for t in ("<pad>", "<eos>", "<unk>", " ", "+", "0")] == [0, 1, 2, 8, 19, 24]
    recipe = json.loads((tiny_warm_start / "sft.json").read_text())
    assert recipe["first_loss"] == pytest.approx(4.540511, rel=1e-4)  # the random model's loss: about ln(103)
    assert recipe["last_loss"] == pytest.approx(3.264289, rel=1e-4)
    weights = load_file(tiny_warm_start / "model.safetensors")
    assert sum(float(w.double().pow(2).sum()) for w in weights.values()) == pytest.approx(823.3906, rel=1e-4)
    assert sum(float(w.double().abs().sum()) for w in weights.values()) == pytest.approx(7788.766, rel=1e-4)


def _fake_cell(run_dir: Path, arm: str, k: int, seed: int, ws: str | None, sha: str | None, accs: list[float]):
    run_dir.mkdir(parents=True)
    records = [{"step": s, "reward/mean": 0.4, "ess/ratio": 0.9, "grad_norm": 1.0} for s in range(1, 21)]
    records[0]["eval/accuracy_initial"] = accs[0]
    for i, acc in enumerate(accs[1:]):
        records[10 * i + 9]["eval/accuracy"] = acc
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "async": {"max_staleness": k}}))
    (run_dir / "summary.json").write_text(json.dumps({"steps": 20, "initial_accuracy": accs[0],
                                                      "final_accuracy": accs[-1], "wall_time_s": 3.0}))
    record = {"warm_start": {"id": ws, "hash": sha}, "git": {"commit": "a" * 40, "dirty": False}} if ws else None
    if record:
        (run_dir / "cell.json").write_text(json.dumps(record))


def test_report_refuses_to_mix_two_models_under_one_warm_start_id(tmp_path):
    cells = tmp_path / "cells"
    _fake_cell(cells / "grpo_k0_w0_s0", "grpo", 0, 0, "w0", "1111", [0.3, 0.4, 0.5])
    _fake_cell(cells / "grpo_k0_w1_s0", "grpo", 0, 0, "w1", "2222", [0.3, 0.4, 0.5])
    text = write_report(tmp_path).read_text()
    assert "Warm start w0: hash 1111" in text and "Code: aaaaaaaaaa." in text
    _fake_cell(cells / "grpo_k16_w0_s0", "grpo", 16, 0, "w0", "3333", [0.3, 0.4, 0.5])
    with pytest.raises(ReportError, match="cells grpo_k0_w0_s0 and grpo_k16_w0_s0 both claim warm start 'w0'"):
        write_report(tmp_path)
    proc = vcpo("report", str(tmp_path), check=False)  # through the command line: one line, exit 2
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "hash 1111 vs 3333" in proc.stderr


def test_sweep_refuses_a_changed_pinned_model_or_another_task(tmp_path):
    model = _model_dir(tmp_path / "w0")
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"trainer": {"max_steps": 2}}))
    runner_calls = []

    def runner(cell, argv):
        runner_calls.append(argv)
        return 1, "not run"

    with pytest.raises(SweepError, match="warm start 'w0' at .* hashes to .*, the grid pins 0000"):
        run_sweep(base, tmp_path / "sw", ["grpo"], [0], [0], run_cell=runner,
                  warm_starts={"w0": WarmStartPin(str(model), "0000")})
    (model / "sft.json").write_text(json.dumps({"task": {"name": "chain_sum", "kwargs": {"min_terms": 5}}}))
    with pytest.raises(SweepError, match="warm start 'w0' was trained on task"):
        run_sweep(base, tmp_path / "sw", ["grpo"], [0], [0], run_cell=runner,
                  warm_starts={"w0": WarmStartPin(str(model), warm_start_hash(model))})
    (model / "sft.json").unlink()
    results = run_sweep(base, tmp_path / "sw", ["grpo"], [0, 4], [1], run_cell=runner,
                        warm_starts={"w0": WarmStartPin(str(model), warm_start_hash(model))})
    assert [r["cell"] for r in results] == ["grpo_k0_w0_s1", "grpo_k4_w0_s1"]
    assert all(f"model.path={model.resolve()}" in argv for argv in runner_calls)
    record = json.loads((tmp_path / "sw/cells/grpo_k0_w0_s1/cell.json").read_text())
    assert record["warm_start"] == {"id": "w0", "path": str(model), "hash": warm_start_hash(model)}
    assert set(record["git"]) == {"commit", "dirty"}


def test_compare_metrics_by_hand():
    committed = [{"step": 1, "reward/mean": 0.12345, "time/step_s": 1.0}, {"step": 2, "reward/mean": 0.5},
                 {"step": 3, "reward/mean": 0.25, "eval/accuracy": 0.4}]
    # 0.1234500001 rounds to 0.12345 (5 significant digits): equal; step 3's accuracy differs by 0.01
    rerun = [{"step": 1, "reward/mean": 0.1234500001, "time/step_s": 7.0}, {"step": 2, "reward/mean": 0.5},
             {"step": 3, "reward/mean": 0.25, "eval/accuracy": 0.41}]
    result = compare_metrics(committed, rerun)
    assert (result["steps_compared"], result["values_compared"], result["mismatches"]) == (3, 7, 1)
    assert result["first_mismatch"] == {"step": 3, "key": "eval/accuracy", "committed": 0.4, "rerun": 0.41}
    assert result["max_abs_diff"] == {"eval/accuracy": pytest.approx(0.01)}
    assert compare_metrics(committed, rerun[:2])["steps_compared"] == 2  # a shorter rerun compares its prefix


def test_rounded_is_idempotent_and_keeps_non_floats():
    assert rounded(0.123456789) == 0.12346 and rounded(rounded(0.123456789)) == 0.12346
    assert rounded(3) == 3 and rounded(None) is None and rounded(1234567.0) == 1234600.0


def test_sweep_then_rerun_through_the_command_line(tmp_path, tiny_warm_start):
    """A pinned tiny warm start, one lagged cell of 4 steps by `vcpo sweep`'s runner, exported, then `vcpo rerun`:
    bit for bit the same metrics (the digest) on the same machine."""
    model = tiny_warm_start
    overrides = ["trainer.max_steps=4", "trainer.eval_every=2", "rollout.prompts_per_step=4", "rollout.group_size=4",
                 "task.eval_size=8", "trainer.checkpoint_every=0"]
    results = run_sweep(STUDY_CONFIG, tmp_path / "sw", ["tis_seq"], [2], [0], workers=1, extra_overrides=overrides,
                        warm_starts={"w0": WarmStartPin(str(model), warm_start_hash(model))})
    assert results[0]["status"] == "done", results[0]
    assert export_sweep(tmp_path / "sw", tmp_path / "committed") == 1
    cell = tmp_path / "committed/cells/tis_seq_k2_w0_s0"
    assert json.loads((cell / "cell.json").read_text())["metrics_digest"]
    proc = vcpo("rerun", str(cell), "--out", str(tmp_path / "again"))
    assert "identical" in proc.stderr and "0 differ" in proc.stderr
    compare = json.loads((tmp_path / "again/compare.json").read_text())
    assert compare["identical"] and compare["digest"]["committed"] == compare["digest"]["rerun"]
    assert vcpo("rerun", str(cell), "--out", str(tmp_path / "again"), check=False).returncode == 2  # not empty


def test_sft_seed_separates_the_warm_start_from_the_rl_seed():
    from vcpo.config import load_config
    from vcpo.train.sft import cache_key, sft_seed

    rl3 = load_config(None, ["seed=3"])
    rl3_ws0 = load_config(None, ["seed=3", "sft.seed=0"])
    assert (sft_seed(rl3), sft_seed(rl3_ws0)) == (3, 0)  # unset: the run's seed, as before the key existed
    assert cache_key(rl3_ws0) == cache_key(load_config(None, ["seed=0"])) != cache_key(rl3)


def test_a_resumed_sweep_refuses_cells_of_an_older_model(tmp_path):
    model = _model_dir(tmp_path / "w0")
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"trainer": {"max_steps": 2}}))
    # a finished cell of an earlier sweep into the same directory, from a model of another hash
    _fake_cell(tmp_path / "sw/cells/grpo_k0_w0_s0", "grpo", 0, 0, "w0", "old0", [0.3, 0.4, 0.5])
    with pytest.raises(SweepError, match="cell grpo_k0_w0_s0 was run from warm start 'w0' of hash old0"):
        run_sweep(base, tmp_path / "sw", ["grpo"], [0], [0], run_cell=lambda cell, argv: (1, ""),
                  warm_starts={"w0": WarmStartPin(str(model), warm_start_hash(model))})


def test_rerun_refuses_what_it_cannot_reproduce(tmp_path):
    from vcpo.study.rerun import RerunError, rerun_cell

    with pytest.raises(RerunError, match="is not a finished study cell"):
        rerun_cell(tmp_path / "nothing", tmp_path / "out")
    cell = tmp_path / "cells/grpo_k0_w0_s0"
    _fake_cell(cell, "grpo", 0, 0, "w0", "1111", [0.3, 0.4, 0.5])
    model = _model_dir(tmp_path / "w0")
    record = json.loads((cell / "cell.json").read_text())
    record["warm_start"]["path"] = str(model)
    (cell / "cell.json").write_text(json.dumps(record))
    with pytest.raises(RerunError, match="was run from warm start 'w0' of hash 1111, but .* hashes to"):
        rerun_cell(cell, tmp_path / "out")
    with pytest.raises(RerunError, match="--steps 99: the committed run has steps 1 to 20"):
        rerun_cell(cell, tmp_path / "out", steps=99)
