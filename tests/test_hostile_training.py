"""A short training run on a task whose scorer ``eval``s completions, with hostile completions slipped into every
batch: nothing escapes, the step metrics count the forced zeros, and the run goes on to its last step."""

from __future__ import annotations

import uuid
from pathlib import Path

import torch

import vcpo.rollout.collect as collect
from vcpo.config import Config, LoggingConfig, RolloutConfig, SFTConfig, TaskConfig, TrainerConfig
from vcpo.loop.trainer import train
from vcpo.models import default as default_model

from conftest import metrics

HANG = "any(iter(int, 1))"


def test_training_continues_through_hostile_rewards(tmp_path, monkeypatch):
    marker = Path(f"/tmp/vcpo-hostile-{uuid.uuid4().hex}")
    hostile = [
        f"__import__('os').system('touch {marker}')",  # a shell command
        f"open('{marker}.w', 'w').write('x')",  # a write outside the scorer's directory
        "[__import__('os').fork() for _ in range(64)]",  # a fork bomb
        HANG,  # an infinite loop: killed at task.reward_timeout_s
    ]
    real = collect.score_completions

    def with_hostile(task, problems, completions):
        return real(task, problems, hostile + list(completions[len(hostile):]))

    monkeypatch.setattr(collect, "score_completions", with_hostile)
    monkeypatch.setattr(default_model, "MAX_POSITIONS", 1280)  # string_insertion prompts run to ~950 characters
    config = Config(
        run_dir=str(tmp_path / "run"),
        task=TaskConfig(name="string_insertion", kwargs={"min_string_length": 5, "max_string_length": 6},
                        eval_size=4, reward_timeout_s=1.0),
        sft=SFTConfig(steps=2, batch_size=4, cache_dir=str(tmp_path / "cache")),
        rollout=RolloutConfig(prompts_per_step=2, group_size=4, max_new_tokens=4),
        trainer=TrainerConfig(max_steps=2, eval_every=0, checkpoint_every=0),
        logging=LoggingConfig(progress=False),
        **{"async": {"mode": "sync", "max_staleness": 0}},
    )
    threads = torch.get_num_threads()
    try:
        summary = train(config)
    finally:  # train() sets process-wide CPU state (vcpo.runtime.configure_cpu); later tests expect the default
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    assert summary["steps"] == 2
    lines = metrics(tmp_path / "run")
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        # The loop, in every batch; on a loaded machine the fork bomb may pass the 1 s deadline too.
        assert 1.0 <= m["reward/timeouts"] <= 2.0
        assert 0.0 <= m["reward/errors"] <= 3.0
    assert not marker.exists() and not Path(f"{marker}.w").exists()
