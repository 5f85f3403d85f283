"""The examples/ end to end: each extension example trains a few steps through the real command line, run from its
own directory as a user would (`cd examples/X && vcpo train -c config.yaml`; the working directory is not on
sys.path, as from the console script), and examples/own_loop.py runs vcpo's pieces in a plain PyTorch loop."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

import pytest
import torch
import yaml

from vcpo.testing.faults import command_env

from conftest import ROOT, metrics

EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> list[str]:
    cache = tmp_path_factory.mktemp("cache")
    return [f"sft.cache_dir={cache}", "sft.steps=20", "sft.batch_size=32", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "task.eval_size=8", "trainer.eval_every=0", "trainer.checkpoint_every=0",
            "logging.progress=false"]


def train_example(name: str, *overrides: str) -> subprocess.CompletedProcess:
    """`vcpo train -c config.yaml ...` in examples/<name>, with ``python -P``: nothing puts that directory on
    sys.path but vcpo's own search of the working directory."""
    proc = subprocess.run([sys.executable, "-P", "-m", "vcpo.cli", "train", "-c", "config.yaml", *overrides],
                          cwd=EXAMPLES / name, capture_output=True, text=True, env=command_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_custom_objective_trains_with_opob_and_the_ess_learning_rate(tiny, tmp_path):
    run = tmp_path / "run"
    train_example("custom_objective", *tiny, f"run_dir={run}", "async.mode=lagged", "async.max_staleness=1",
                  "trainer.max_steps=3", "trainer.lr=1e-3")
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert all("tempered/weight_mean" in m and m["opob/second_backward"] == 0.0 for m in lines)  # the user's loss
    stale = [m for m in lines if m["staleness/max"] >= 1]
    assert stale and all(m["tempered/weight_mean"] != 1.0 for m in stale)  # lagged data: weights moved off 1
    assert all(m["lr"] == pytest.approx(1e-3 * math.sqrt(min(1.0, m["ess/ratio"]))) for m in lines)
    assert yaml.safe_load((run / "config.yaml").read_text())["objective"]["name"] == "tempered_is:tempered_tis"


def test_custom_reward_scores_the_jsonl_dataset_in_the_async_workers(tiny, tmp_path):
    run = tmp_path / "run"
    train_example("custom_reward", *tiny, f"run_dir={run}", "trainer.max_steps=3")
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert all(m["reward/errors"] == 0 and m["reward/timeouts"] == 0 for m in lines)
    # char_match gives partial credit (thirds of a word): 16 rewards of 0 or 1 could only average to k/16.
    assert any(abs(m["reward/mean"] * 16 - round(m["reward/mean"] * 16)) > 1e-3 for m in lines)


def test_custom_multiturn_environment_runs_episodes_in_the_async_workers(tiny, tmp_path):
    run = tmp_path / "run"
    train_example("custom_env", *tiny, f"run_dir={run}", "trainer.max_steps=2")
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["tools/turns_mean"] > 1.0 and 0.0 < m["tools/masked_frac"] < 1.0  # hints in the context, mask 0
        assert 0.0 <= m["reward/mean"] <= 1.0
    assert "eval/accuracy" in lines[-1]


@pytest.mark.slow
def test_openai_agent_runs_its_episodes_through_the_endpoint_in_the_async_workers(tiny, tmp_path):
    run = tmp_path / "run"
    train_example("openai_agent", *tiny, f"run_dir={run}", "trainer.max_steps=2", "rollout.max_new_tokens=24",
                  "trainer.eval_every=2", "task.eval_size=4")
    lines = metrics(run)
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["batch/groups"] == 4 and "agent/dropped_groups" not in m
        assert m["tools/turns_mean"] >= 1.0 and 0.0 <= m["reward/mean"] <= 1.0  # the agent's calls per episode
    assert "eval/accuracy" in lines[-1]  # the native tool task's greedy episodes


def test_own_loop_uses_stale_behaviour_log_probs_opob_and_the_ess_learning_rate():
    spec = importlib.util.spec_from_file_location("own_loop", EXAMPLES / "own_loop.py")
    own_loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(own_loop)
    lr = 3e-3
    history = own_loop.train(steps=4, lag=2, prompts_per_step=4, group_size=8, lr=lr, say=lambda *_: None)
    assert [h["lag"] for h in history] == [0, 1, 0, 1]
    varied = []  # (step record, group id) of every group whose rewards differ
    for h in history:
        logw = torch.tensor(h["logw"], dtype=torch.float64)
        if h["lag"] == 0:  # sampled by the learner's own weights: recorded log-probs equal the recomputed ones
            assert logw.abs().max() < 1e-4 and h["ess_ratio"] > 0.9999
        else:  # one step stale: every weight moved off 1, and ESS fell below B
            assert (logw.abs() > 1e-4).all() and h["ess_ratio"] < 0.9999
        assert h["lr"] == pytest.approx(lr * math.sqrt(min(1.0, h["ess_ratio"])))
        assert all(g > 0 for g in h["G"]) and math.isfinite(h["loss"])
        groups = {g: {r for r, i in zip(h["rewards"], h["group_ids"], strict=True) if i == g} for g in h["group_ids"]}
        varied += [(h, g) for g, rewards in groups.items() if len(rewards) > 1]
        assert (h["grad_norm"] > 0) == any(len(rewards) > 1 for rewards in groups.values())  # else every A is 0
    # OPOB on the stale steps: each group's baseline b_g = sum W^2 G R / sum W^2 G, recovered from the advantages
    # (R - b_g) / sigma_g, and not the group's mean reward, since the weights W are unequal there.
    stale = [(h, g) for h, g in varied if h["lag"] == 1]
    assert stale, "no group with different rewards in a stale step"
    for h, g in stale:
        rows = torch.tensor(h["group_ids"]) == g
        logw, G, R, A = (torch.tensor(h[k], dtype=torch.float64)[rows] for k in ("logw", "G", "rewards", "advantages"))
        baseline = (torch.exp(2 * logw) * G * R).sum() / (torch.exp(2 * logw) * G).sum()
        assert torch.allclose(R - A * R.std(unbiased=False), baseline.expand_as(R), atol=1e-5)
        assert abs(float(baseline - R.mean())) > 1e-6


def test_trl_example_trains_and_cuts_the_lr_of_each_reused_step():
    spec = importlib.util.spec_from_file_location("trl_vcpo", EXAMPLES / "trl_vcpo.py")
    trl_vcpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trl_vcpo)
    logs = trl_vcpo.main(steps=4)
    assert [line["step"] for line in logs] == [1, 2, 3, 4]
    assert all(math.isfinite(line["loss"]) for line in logs)
    assert logs[1]["ess/ratio"] < 1.0 and logs[1]["lr_scale"] < 1.0 and logs[0]["lr_scale"] == 1.0
