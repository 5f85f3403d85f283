"""An agent task end to end through the real command line: a few steps of an OpenAI-client agent (two completion
calls an episode) in each ``async.mode``, on a barely warm-started model (the run's shape and metrics, not
learning), and a run whose every agent fails (each group dropped and counted, the run still finishing)."""

from __future__ import annotations

import pytest

from conftest import metrics, vcpo

PROBLEMS = ("task.kwargs={problems: chain_sum, problem_kwargs: {min_terms: 2, max_terms: 2, min_digits: 1, "
         "max_digits: 1}}")
AGENT = ["task.name=agent:tests.agents_for_tests:sum_agent", PROBLEMS]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> list[str]:
    cache = tmp_path_factory.mktemp("cache")
    return ["-c", "configs/quickstart.yaml", f"sft.cache_dir={cache}", "sft.steps=4", "sft.batch_size=8",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=6", "task.eval_size=4",
            "trainer.eval_every=3", "trainer.checkpoint_every=3", "trainer.max_steps=3", "logging.progress=false"]


@pytest.mark.parametrize("mode", ["sync", "lagged", "async"])
def test_an_openai_agent_trains_a_few_steps_in_every_mode(tmp_path, tiny, mode):
    run = tmp_path / mode
    vcpo("train", *tiny, *AGENT, f"run_dir={run}", f"async.mode={mode}", "async.max_staleness=1")
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        assert m["batch/groups"] == 2 and m["batch/size"] == 4  # one row per episode: its two calls joined
        assert m["tools/turns_mean"] == 2.0 and 0.0 < m["tools/masked_frac"] < 1.0  # the "\n" between calls
        assert m["staleness/max"] <= 1
        assert "agent/dropped_groups" not in m
    assert "eval/accuracy" in lines[-1]


def test_failing_agents_drop_their_groups_count_them_and_a_batch_of_none_stops_the_run(tmp_path, tiny):
    # seed 0's first batches (2 prompts each): answers (-4, 11), (11, 7), (-3, 3); picky_agent raises on 11
    run = tmp_path / "picky"
    proc = vcpo("train", *tiny, "task.name=agent:tests.agents_for_tests:picky_agent", PROBLEMS, f"run_dir={run}",
                "async.mode=sync")
    lines = metrics(run)
    assert [m["batch/groups"] for m in lines] == [1, 1, 2]
    assert [m["agent/dropped_groups"] for m in lines] == [1, 2, 2]
    failures = [line for line in proc.stderr.splitlines() if "raised ValueError: eleven is not my number" in line]
    assert len(failures) == 4  # two episodes in each of two groups, one line each
    broken = vcpo("train", *tiny, "task.name=agent:tests.agents_for_tests:broken_agent", PROBLEMS,
                  f"run_dir={tmp_path / 'broken'}", "async.mode=sync", check=False)
    assert broken.returncode == 1
    assert "every group of batch 0 was dropped by the agent task" in broken.stderr
