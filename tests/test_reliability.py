"""No silent failure and no lost work, piece by piece: non-finite samples and steps are skipped and counted,
non-finite weights are never checkpointed, resume skips a corrupt checkpoint, disk errors are one line
naming the path, a failed start removes what it wrote."""

from __future__ import annotations

import errno
import math
import os

import pytest
import torch
import transformers

from vcpo.config import ConfigError, load_config
from vcpo.errors import DiskError
from vcpo.loop.health import RunHealth
from vcpo.loop.trainer import restore
from vcpo.metrics import MetricsLogger
from vcpo.models.default import build_char_tokenizer
from vcpo.rollout.engine import HFRolloutEngine, sample_next
from vcpo.tasks import TaskError
from vcpo.train.checkpoint import CheckpointError, latest_checkpoint, save_checkpoint
from vcpo.train.learner import Learner
from vcpo.train.run_dir import RunDirectory, check_start, check_writable
from vcpo.types import Batch, SamplingParams, Trajectory


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=32)
    return transformers.LlamaForCausalLM(cfg).eval()


def batch(blp_last: float = -1.0, reward: float = 1.0) -> Batch:
    trajs = [Trajectory("u", 0, [3, 4], [5, 6], [-0.5, blp_last], [0, 0], reward, True, SamplingParams()),
             Trajectory("u", 0, [3, 4], [7], [-2.0], [0], 0.0, True, SamplingParams())]
    return Batch.from_trajectories(trajs, pad_id=0)


def test_a_row_with_broken_logits_is_marked_not_crashed():
    logits_BV = torch.tensor([[0.0, 0.0], [float("nan"), 1.0], [float("inf"), 0.0], [-float("inf"), -float("inf")]])
    for greedy in (False, True):
        tokens_B, logprobs_B = sample_next(logits_BV, SamplingParams(top_p=0.9), torch.Generator().manual_seed(0),
                                           greedy=greedy)
        assert logprobs_B[0] == pytest.approx(math.log(0.5))  # two equal logits: mu = 1/2 whichever is drawn
        assert tokens_B[1:].tolist() == [0, 0, 0] and bool(torch.isnan(logprobs_B[1:]).all())


def test_the_engine_ends_a_row_sampled_from_nan_weights():
    model = tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    gens = HFRolloutEngine(model, eos_id=1, pad_id=0).generate([[3, 4], [5]], SamplingParams(max_new_tokens=4))
    for g in gens:  # one token each, marked, unfinished
        assert len(g.response_ids) == 1 and math.isnan(g.behavior_logprobs[0]) and not g.finished


@pytest.mark.parametrize(("blp_last", "reward", "reason"), [
    (float("nan"), 1.0, "non-finite sampling log-prob"),
    (-1.0, float("nan"), "non-finite loss"),  # a NaN reward makes NaN advantages, hence a NaN loss
])
def test_a_non_finite_step_is_skipped_and_leaves_the_weights(blp_last, reward, reason):
    learner = Learner(tiny_llama(), load_config(None, ["advantage.estimator=grpo", "objective.name=tis"]))
    before = [p.detach().clone() for p in learner.params]
    metrics = learner.step(batch(blp_last, reward))
    assert (metrics["skipped_step"], learner.skip_reason, learner.version) == (1.0, reason, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, learner.params, strict=True))
    metrics = learner.step(batch())
    assert (metrics["skipped_step"], learner.skip_reason) == (0.0, None)


def test_run_health_counts_consecutive_skips_and_sums_reward_errors():
    health = RunHealth()
    for skipped, errors in [(1, 2), (1, None), (0, 1), (1, float("nan"))]:
        health.record({"skipped_step": float(skipped), "reward/errors": errors})
    # skips 1+1+0+1 = 3, the last run of them is 1 long; errors 2 + 1 (None and NaN count 0)
    assert (health.skipped_steps, health.consecutive_skipped, health.reward_errors) == (3, 1, 3)
    counts = health.counts({"staleness/dropped_over_bound": 2.0, "staleness/dropped_alpha": 1.0,
                            "async/worker_restarts": 1.0})
    assert (counts["dropped_groups"], counts["worker_restarts"]) == (3, 1)
    assert RunHealth.from_state(health.state()) == health


def saved_run(tmp_path, steps=(2, 4)) -> Learner:
    learner = Learner(tiny_llama(), load_config(None, []))
    for step in steps:
        save_checkpoint(tmp_path, step, learner.model, build_char_tokenizer("0123"), learner.optimizer, {})
    return learner


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    learner = saved_run(tmp_path, steps=(2,))
    with torch.no_grad():
        learner.model.model.norm.weight[0] = float("inf")
    with pytest.raises(CheckpointError, match="step 3: model.norm.weight holds non-finite values"):
        save_checkpoint(tmp_path, 3, learner.model, build_char_tokenizer("0123"), learner.optimizer, {})
    assert latest_checkpoint(tmp_path).name == "step_000002"


@pytest.mark.parametrize(("damage", "why"), [
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100]), "corrupt"),
    (lambda d: (d / "trainer_state.json").write_text("{not json"), "corrupt"),
    (lambda d: (d / "optimizer.pt").unlink(), "no optimizer.pt"),
])
def test_resume_falls_back_to_the_newest_loadable_checkpoint(tmp_path, capsys, damage, why):
    saved_run(tmp_path)
    damage(tmp_path / "checkpoints" / "step_000004")
    learner = Learner(tiny_llama(), load_config(None, []))
    state, ckpt = restore(tmp_path, learner)
    assert (ckpt.name, learner.version, state["step"]) == ("step_000002", 2, 2)
    warning = capsys.readouterr().err
    assert "skipping checkpoint step_000004" in warning and why in warning


def test_resume_with_no_loadable_checkpoint_names_them_all(tmp_path):
    saved_run(tmp_path)
    for d in (tmp_path / "checkpoints").glob("step_*"):
        (d / "rng.pt").unlink()
    with pytest.raises(CheckpointError, match="no loadable checkpoint .*step_000004, step_000002"):
        restore(tmp_path, Learner(tiny_llama(), load_config(None, [])))


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    learner = saved_run(tmp_path, steps=(2,))
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(DiskError) as info:
        save_checkpoint(tmp_path, 3, learner.model, build_char_tokenizer("0123"), learner.optimizer, {})
    assert str(info.value) == f"cannot write '{tmp_path}/checkpoints/step_000003.tmp-{os.getpid()}': " \
                              "No space left on device"
    assert latest_checkpoint(tmp_path).name == "step_000002"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000002"]


def test_a_full_disk_while_logging_names_the_metrics_file(tmp_path, monkeypatch):
    with MetricsLogger(tmp_path) as logger:
        monkeypatch.setattr(os, "fsync", full_disk)
        with pytest.raises(DiskError, match="metrics.jsonl': No space left on device"):
            logger.log({"step": 1, "reward/mean": 0.5})


def test_a_read_only_run_dir_is_found_before_the_run(tmp_path, monkeypatch):
    import tempfile

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    with pytest.raises(DiskError, match=f"cannot write '{tmp_path}': Read-only file system"):
        check_writable(tmp_path / "new" / "run", "run_dir")


def test_a_fresh_start_refuses_a_run_with_checkpoints(tmp_path):
    saved_run(tmp_path, steps=(2,))
    with pytest.raises(ConfigError, match="--resume"):
        check_start(load_config(None, [f"run_dir={tmp_path}", "model.path=null"]), resume=False)


def test_a_failed_fresh_start_removes_only_what_it_wrote(tmp_path):
    cfg = load_config(None, [])
    new = RunDirectory(tmp_path / "new", resume=False)
    new.open(cfg)
    assert (tmp_path / "new" / "config.yaml").is_file()
    new.discard()
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine.txt").write_text("keep")
    existing = RunDirectory(tmp_path, resume=False)
    existing.open(cfg)
    existing.discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]
    resumed = RunDirectory(tmp_path, resume=True)
    resumed.open(cfg)
    resumed.discard()  # a resumed run's directory is never removed
    assert (tmp_path / "config.yaml").is_file()


def test_a_failed_start_leaves_no_run_directory(tmp_path, monkeypatch):
    import vcpo.loop.trainer as trainer

    model_dir = tmp_path / "model"
    tiny_llama().save_pretrained(model_dir)
    build_char_tokenizer("0123456789+= ").save_pretrained(model_dir)
    run_dir = tmp_path / "run"
    common = [f"run_dir={run_dir}", f"model.path={model_dir}", "logging.progress=false", "task.eval_size=2"]
    with pytest.raises(TaskError, match="no_such_task"):  # found after the heavy imports, before any write
        trainer.train(load_config(None, [*common, "task.name=no_such_task"]))
    assert not run_dir.exists()

    def broken_source(*args, **kwargs):
        raise RuntimeError("the rollout source could not start")

    monkeypatch.setattr(trainer, "make_source", broken_source)  # fails after config.yaml was written
    with pytest.raises(RuntimeError, match="could not start"):
        trainer.train(load_config(None, common))
    assert not run_dir.exists()


def test_summary_counts_reach_the_final_line():
    from vcpo.loop.health import describe

    line = describe({"initial_accuracy": 0.3, "final_accuracy": 0.0, "steps": 4, "wall_time_s": 2.0, "run_dir": "r",
                     "skipped_steps": 3, "dropped_groups": 1, "reward_errors": 2, "reward_timeouts": 1,
                     "worker_restarts": 1})
    assert line == ("held-out accuracy: 0.300 before RL -> 0.000 after 4 steps (2 s); skipped steps 3, dropped "
                    "groups 1, reward errors 2 (timeouts 1), worker restarts 1, health alarms 0; run: r")
    line = describe({"initial_accuracy": 0.3, "final_accuracy": 0.0, "steps": 4, "wall_time_s": 2.0, "run_dir": "r",
                     "skipped_steps": 0, "dropped_groups": 0, "reward_errors": 0, "reward_timeouts": 0,
                     "worker_restarts": 0, "alarms": {"nonfinite": 0, "ess": 3, "dead_policy": 1}, "rollbacks": 1,
                     "lr_factor": 0.5})
    assert line.endswith("worker restarts 0, health alarms 4 (ess 3, dead_policy 1), rollbacks 1 (learning rate "
                         "x0.5); run: r")


def test_a_checkpoint_set_aside_is_never_resumed_from(tmp_path):
    from vcpo.train.checkpoint import set_aside

    saved_run(tmp_path)  # steps 2 and 4; latest = 4
    assert set_aside(tmp_path, 4).name == "step_000002"
    assert latest_checkpoint(tmp_path).name == "step_000002"
    assert (tmp_path / "checkpoints" / "step_000004.suspect" / "trainer_state.json").is_file()
    assert set_aside(tmp_path, 2) is None and latest_checkpoint(tmp_path) is None
