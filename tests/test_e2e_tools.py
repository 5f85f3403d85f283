"""The tool task end to end through the real command line: a few steps of configs/tools.yaml in sync and async
mode on a barely warm-started model (the metrics' keys and ranges, not learning: that is benchmarks/tools)."""

from __future__ import annotations

import pytest

from conftest import metrics, vcpo

TOOL_KEYS = {"tools/calls_per_episode", "tools/turns_mean", "tools/errors", "tools/void_frac", "tools/masked_frac"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> list[str]:
    cache = tmp_path_factory.mktemp("cache")
    return ["-c", "configs/tools.yaml", f"sft.cache_dir={cache}", "sft.steps=4", "sft.batch_size=8",
            "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=24", "task.eval_size=4",
            "trainer.eval_every=2", "trainer.max_steps=2", "logging.progress=false"]


@pytest.mark.parametrize("mode", ["async"])  # sync and lagged share its rollout code in-process
def test_tool_task_trains_a_few_steps_and_logs_tool_metrics(tmp_path, tiny, mode):
    run = tmp_path / mode
    vcpo("train", *tiny, f"run_dir={run}", f"async.mode={mode}")
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert TOOL_KEYS <= m.keys()
        assert 1.0 <= m["tools/turns_mean"] <= 3.0 and 0.0 <= m["tools/masked_frac"] < 1.0
        assert m["staleness/max"] <= 2
    assert "eval/accuracy" in lines[-1]
