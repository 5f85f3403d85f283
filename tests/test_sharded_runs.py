"""`vcpo train ... trainer.num_learners=2 trainer.sharding=fsdp` through the real command line: two sharded learner
processes train like one process (the lagged reference run of conftest), their checkpoint resumes on one process and
on four sharded ranks to the same metrics, and `vcpo export` turns it into a Hugging Face directory that transformers
loads with one process's weights; unsharded local ranks resume like one process too."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from vcpo.config import ConfigError, load_config

from conftest import LAGGED, metrics, vcpo

FSDP = ["trainer.num_learners=2", "trainer.sharding=fsdp"]


def assert_same_metrics(reference: list[dict], run: list[dict]) -> None:
    """Equal samples (rewards, evaluations) and every other metric within float32 rounding of the reference's."""
    assert [m["step"] for m in run] == [m["step"] for m in reference]
    for ref, got in zip(reference, run, strict=True):
        assert {k for k in got if not k.startswith("time/")} == {k for k in ref if not k.startswith("time/")}
        for key, value in ref.items():
            if key.startswith("time/"):
                continue
            if key.startswith(("reward/", "eval/", "response/length", "staleness/")):
                assert got[key] == value, (ref["step"], key)
            else:
                assert math.isclose(got[key], value, rel_tol=1e-4, abs_tol=1e-5), (ref["step"], key, got[key], value)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory, tiny) -> tuple:
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    vcpo("train", *tiny, *LAGGED, *FSDP, f"run_dir={run_dir}")
    return run_dir


def test_two_sharded_ranks_train_like_one_process(sharded_run, lagged_full):
    assert_same_metrics(metrics(lagged_full), metrics(sharded_run))
    step = sharded_run / "checkpoints" / "step_000002"
    assert (step / "sharded").is_dir() and not list(step.glob("*.safetensors"))  # shards, no whole copy
    assert all(m["time/weight_gather_s"] > 0 for m in metrics(sharded_run))  # the ranks into the mirror


@pytest.mark.parametrize("learners", [  # one process unsharded; 4 ranks (slow tier); a world of one
    ["trainer.num_learners=1", "trainer.sharding=none"],
    pytest.param(["trainer.num_learners=4"], marks=pytest.mark.slow),
    ["trainer.num_learners=1"]])
def test_a_two_rank_checkpoint_resumes_on_one_process_and_on_four_ranks(tmp_path, sharded_run, lagged_full,
                                                                        learners):
    part = tmp_path / "part"
    shutil.copytree(sharded_run, part)
    shutil.rmtree(part / "checkpoints" / "step_000004")
    (part / "checkpoints" / "latest").write_text("step_000002\n")
    vcpo("train", "--resume", str(part), *learners)
    assert_same_metrics(metrics(lagged_full), metrics(part))


@pytest.mark.slow
def test_two_unsharded_local_ranks_resume_like_one_process(tmp_path, tiny, lagged_full):
    """trainer.num_learners=2 without sharding: local data-parallel ranks; a resume hands each rank its own copy of
    the optimizer state."""
    run = tmp_path / "dp"
    vcpo("train", *tiny, *LAGGED, "trainer.num_learners=2", f"run_dir={run}", "trainer.max_steps=2")
    vcpo("train", "--resume", str(run), "trainer.max_steps=4")
    assert_same_metrics(metrics(lagged_full), metrics(run))


def test_export_of_a_sharded_checkpoint_is_one_process_model(tmp_path, sharded_run, lagged_full):
    out = tmp_path / "hf"
    vcpo("export", str(sharded_run / "checkpoints" / "step_000004"), "--out", str(out))
    exported = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    reference = AutoModelForCausalLM.from_pretrained(lagged_full / "checkpoints" / "step_000004", local_files_only=True)
    for key, value in reference.state_dict().items():
        assert float((exported.state_dict()[key] - value).norm()) <= 1e-5 * float(value.norm()), key
    assert exported.dtype == torch.float32


@pytest.mark.parametrize(("overrides", "message"), [
    ([*FSDP, "advantage.grad_norm_method=exact"], "advantage.grad_norm_method=exact with trainer.sharding=fsdp"),
    ([*FSDP, "model.lm_head_fp32=true"], "model.lm_head_fp32 with trainer.sharding=fsdp"),
    ([*FSDP, "async.backend=ray", "ray.weight_sync=broadcast"], "ray.weight_sync=broadcast with trainer.sharding"),
])
def test_what_sharding_cannot_be_combined_with_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/quickstart.yaml", overrides)
