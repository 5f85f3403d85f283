"""`vcpo train` starting its own inference servers (``rollout.server.launch``), here `vcpo serve` ones (tests/with_vllm
launches real vLLM): the run trains through them and leaves none behind, a server that cannot start is one error with
its log's tail, and a trainer killed with SIGKILL takes its servers' whole process trees with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vcpo.rollout.launch import server_command

from conftest import ROOT, metrics, processes_with, save_tiny_policy


def train_args(policy: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "vcpo.cli", "train", "-c", "configs/quickstart.yaml", f"run_dir={run_dir}",
            f"model.path={policy}", "rollout.engine=server", "rollout.server.kind=vcpo",
            "rollout.server.launch={num_servers: 2, startup_timeout_s: 120}", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "rollout.max_new_tokens=6", "task.eval_size=8", "trainer.eval_every=0",
            "trainer.checkpoint_every=0", "logging.progress=false", *extra]


def run(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(args, env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_gone(marker: str, timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_the_start_command_is_local_and_matches_the_learners_numerics():
    cmd = server_command("vllm", "py", "/m", 8123, "float64", ["--enforce-eager"])
    assert cmd == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--host", "127.0.0.1",
                   "--port", "8123", "--dtype", "float32", "--logprobs-mode", "processed_logprobs", "--enforce-eager"]


def test_a_run_starts_its_servers_trains_through_them_and_stops_them(tmp_path):
    policy = save_tiny_policy(tmp_path / "policy-launch")
    proc = run(train_args(policy, tmp_path / "run", "async.mode=sync", "trainer.max_steps=2"))
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "rollout servers up: http://127.0.0.1:" in out + err
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "run" / "server_logs").iterdir()) == ["server0.log", "server1.log"]
    assert wait_gone(str(policy), 10) == []


def test_dynamic_sampling_refills_through_the_servers_in_async_mode(tmp_path):
    policy = save_tiny_policy(tmp_path / "policy-filter")
    run_dir = tmp_path / "run"
    proc = run(train_args(policy, run_dir, "async.mode=async", "async.max_staleness=1", "trainer.max_steps=2",
                          "rollout.filter=zero_variance", "rollout.filter_max_factor=2"))
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    lines = metrics(run_dir)
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:  # 4 groups trained a step, out of 4 to floor(2 x 4) = 8 judged
        assert m["batch/groups"] == 4 and m["groups/trained_count"] == 4
        assert 1.0 <= m["filter/groups_per_trained"] <= 2.0 and m["staleness/max"] <= 1
        assert m["reward/zero_var_group_frac"] == 0.0 or m["filter/cap_hit"] == 1.0
        assert m["groups/generated_count"] >= 4 * m["filter/groups_per_trained"] - 1e-9
    assert wait_gone(str(policy), 10) == []


def test_a_server_that_cannot_start_is_one_error_with_its_logs_tail(tmp_path):
    policy = save_tiny_policy(tmp_path / "policy-bad")
    proc = run(train_args(policy, tmp_path / "run", "trainer.max_steps=2", "rollout.server.launch.num_servers=1",
                          "rollout.server.launch.extra_args=[--no-such-flag]"))
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 1
    assert "launched rollout server 0 (vcpo, http://127.0.0.1:" in err and "exited during startup" in err
    assert "No such option: --no-such-flag" in err  # the log's tail, printed
    assert wait_gone(str(policy), 10) == []


def test_a_trainer_killed_with_sigkill_leaves_no_server_behind(tmp_path):
    policy = save_tiny_policy(tmp_path / "policy-kill")
    proc = run(train_args(policy, tmp_path / "run", "async.mode=async", "trainer.max_steps=200"))
    try:
        deadline = time.monotonic() + 300
        while not metrics(tmp_path / "run"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.1)
        servers = [pid for pid in processes_with(str(policy)) if pid != proc.pid]
        assert len(servers) >= 4  # two guards and two servers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert wait_gone(str(policy)) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in processes_with(str(policy)):  # only if the test failed: nothing of it outlives the test
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("override", ["rollout.server.urls=[http://127.0.0.1:1]", "rollout.server.kind=sglang"])
def test_launch_with_urls_or_sglang_is_a_config_error(override, tmp_path):
    args = train_args(tmp_path / "none", tmp_path / "run", override)
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and "rollout.server.launch" in proc.stderr
