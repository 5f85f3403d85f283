"""Fault injection through the real command line, the fast cases of benchmarks/fault_injection.py: kill -9 of
a rollout worker (restarted, then out of restarts), kill -9 of the trainer (no process or shared-memory
segment left), each resumed to the end with no step lost or repeated; a lagged run stopped by SIGTERM
(a checkpoint, exit 143) resumes to the same metrics as an uninterrupted one; an async run stopped by SIGTERM trains
every prompt of the stream once after its resume; non-finite steps stop a run; failed commands change nothing."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from vcpo.config import load_config, save_config
from vcpo.testing.faults import descendants, shm_segments, start_train, wait_for_lines, wait_gone, worker_pids

from conftest import LAGGED, NAN_GRADIENT_FROM_STEP_2, ROOT, metrics, patched_cli, vcpo


class Run:
    """A `vcpo train` process in its own session (so that the test can always clean it up)."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.log = tmp_path / f"log-{time.monotonic_ns()}.txt"
        self.proc = start_train(list(args), self.log, ROOT)

    def finish(self, timeout_s: float = 300) -> tuple[int, list[str]]:
        code = self.proc.wait(timeout=timeout_s)
        return code, [line for line in self.log.read_text().splitlines() if line.strip()]

    def cleanup(self) -> None:
        """Kill whatever of its process group is left, even when a failed assertion left it running."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@pytest.fixture
def runs(tmp_path):
    started: list[Run] = []

    def start(*args: str) -> Run:
        started.append(Run(tmp_path, *args))
        return started[-1]

    yield start
    for run in started:
        run.cleanup()


def steps(run_dir: Path) -> list[int]:
    return [m["step"] for m in metrics(run_dir)]


def wait_for_restart_in_checkpoint(run_dir: Path, proc, timeout_s: float = 300) -> None:
    """Until the latest checkpoint counts a worker restart (so that the kill below cannot lose it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            latest = (run_dir / "checkpoints" / "latest").read_text().strip()
            state = json.loads((run_dir / "checkpoints" / latest / "trainer_state.json").read_text())
            if state["source"]["worker_restarts"] == 1:
                return
        except (OSError, ValueError, KeyError):  # between a checkpoint's rename and its 'latest' file
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint counted the restart"
        time.sleep(0.05)


@pytest.mark.slow
def test_async_run_survives_worker_kills_and_a_trainer_kill(tmp_path, tiny, runs):
    run_dir = tmp_path / "async"
    args = [*tiny, f"run_dir={run_dir}", "async.mode=async", "async.max_staleness=1", "trainer.max_steps=8"]
    first = runs(*args, "async.max_worker_restarts=0")
    wait_for_lines(run_dir / "metrics.jsonl", 1, first.proc)
    os.kill(worker_pids(first.proc.pid)[0], signal.SIGKILL)  # no restart allowed: the run stops with a checkpoint
    code, lines = first.finish()
    done = len(steps(run_dir))
    assert code == 1 and lines[-1] == (
        f"error: stopped at step {done}: rollout worker 0 was killed by SIGKILL; no restart left "
        f"(async.max_worker_restarts=0); the latest checkpoint is step {done}; continue with --resume {run_dir}")

    second = runs("--resume", str(run_dir), "async.max_worker_restarts=1")
    wait_for_lines(run_dir / "metrics.jsonl", done + 1, second.proc)
    os.kill(worker_pids(second.proc.pid)[0], signal.SIGKILL)  # restarted, its groups re-issued
    wait_for_restart_in_checkpoint(run_dir, second.proc)
    family = descendants(second.proc.pid)
    segments = shm_segments([second.proc.pid, *family])
    assert family and segments
    second.proc.kill()  # kill -9 of the trainer: nothing outlives it
    second.proc.wait()
    wait_gone(family)
    assert [s for s in segments if os.path.exists(s)] == []
    assert "restarted it (1 of 1)" in second.log.read_text()

    code, lines = runs("--resume", str(run_dir)).finish()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert code == 0 and steps(run_dir) == list(range(1, 9))  # no step lost or repeated
    assert (summary["status"], summary["worker_restarts"]) == ("completed", 1)
    # (the tiny warm start at lr 1e-3 may drift towards a uniform policy in 8 steps: an alarm is no failure here)
    assert re.search(rf"worker restarts 1, health alarms \d+( \([a-z_ 0-9,]+\))?; run: {re.escape(str(run_dir))}$",
                     lines[-1]), lines[-1]


def test_a_lagged_run_stopped_by_sigterm_resumes_to_the_uninterrupted_metrics(tmp_path, tiny, lagged_full, runs):
    run_dir = tmp_path / "part"
    part = runs(*tiny, *LAGGED, f"run_dir={run_dir}")
    wait_for_lines(run_dir / "metrics.jsonl", 2, part.proc)
    part.proc.send_signal(signal.SIGTERM)
    code, lines = part.finish()
    done = len(steps(run_dir))
    assert code == 143 and lines[-1] == (f"interrupted by SIGTERM after step {done}: the latest checkpoint is step "
                                         f"{done}; continue with --resume {run_dir}")
    vcpo("train", "--resume", str(run_dir))

    def without_times(run: Path) -> list[dict]:
        return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in metrics(run)]

    assert without_times(run_dir) == without_times(lagged_full)


ASYNC_NO_DROPS = ["async.mode=async", "async.num_workers=1", "async.max_staleness=8", "trainer.max_steps=8"]
"""An async run that never drops a group (k = 8 > 7, the largest lag 8 steps allow) with one worker, which returns its
groups in stream order: uninterrupted, steps 1-8 train prompts 0..31 (4 a step), each once."""


def trained_groups(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "trained_groups.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("order", ["arrival", "admission"])
def test_an_async_run_stopped_by_sigterm_trains_every_prompt_once_after_resume(tmp_path, tiny, runs, order):
    # admission order with 2 workers: they overtake each other, yet every step takes the next 4 prompts of the stream
    extra = ["async.batch_order=admission", "async.num_workers=2"] if order == "admission" else []
    run_dir = tmp_path / "part"
    part = runs(*tiny, *ASYNC_NO_DROPS, *extra, f"run_dir={run_dir}")
    wait_for_lines(run_dir / "metrics.jsonl", 2, part.proc)
    part.proc.send_signal(signal.SIGTERM)  # the worker runs ahead by up to (k + 1) * 4 groups: some done, some not
    code, lines = part.finish()
    done = len(steps(run_dir))
    assert code == 143, lines[-5:]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    saved = json.loads((run_dir / "checkpoints" / latest / "trainer_state.json").read_text())["source"]
    queued = [(g[0]["group_id"], min(min(t["versions"]) for t in g)) for g in saved["queued"]]
    assert queued or saved["requeued"], "nothing was queued or in flight at the stop: the test proves nothing"
    vcpo("train", "--resume", str(run_dir))

    records = trained_groups(run_dir)
    assert [r["step"] for r in records] == [t for t in range(1, 9) for _ in range(4)]
    # none skipped, none twice: what the uninterrupted run trains (ASYNC_NO_DROPS)
    assert sorted(r["prompt_index"] for r in records) == list(range(32))
    after = records[4 * done:]
    lengths = {g[0]["group_id"]: sum(len(t["response_ids"]) for t in g) / len(g) for g in saved["queued"]}
    if order == "admission":
        # in stream order throughout, across the stop: the held groups, finished or not, slot in by index; the
        # finished ones as generated (their versions and lengths kept)
        assert [r["prompt_index"] for r in records] == list(range(32))
        assert sorted(g for g, _ in queued) == [g for g, _ in queued]
        assert all((r["version"], r["length_mean"]) == (dict(queued)[r["prompt_index"]], lengths[r["prompt_index"]])
                   for r in after if r["prompt_index"] in lengths)
        return
    # first the groups that had finished at the stop, as generated (their versions and lengths kept), then the
    # prompts that were in flight, generated again
    assert [(r["prompt_index"], r["version"]) for r in after[:len(queued)]] == queued[:len(after)]
    assert all(r["length_mean"] == lengths[r["prompt_index"]] for r in after[:len(queued)])
    regenerated = [r["prompt_index"] for r in after[len(queued):]]
    assert regenerated == saved["requeued"][:len(regenerated)]
    # (a saved group beyond the bound after a resume is dropped and counted: tests/test_process_lifecycle.py)


def test_a_failed_resume_leaves_config_yaml_as_it_was(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_config(load_config(None, [f"run_dir={run_dir}"]), run_dir / "config.yaml")
    before = (run_dir / "config.yaml").read_bytes()
    proc = vcpo("train", "--resume", str(run_dir), f"model.path={tmp_path / 'bad'}", check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: model path '{tmp_path / 'bad'}' does not exist"
    assert (run_dir / "config.yaml").read_bytes() == before


def test_consecutive_non_finite_steps_stop_the_run_and_are_counted(tmp_path, tiny):
    run_dir = tmp_path / "run"
    proc = vcpo("train", *tiny, f"run_dir={run_dir}", "async.mode=sync", "trainer.max_steps=10",
                "trainer.max_skipped_steps=2", "trainer.checkpoint_every=1", check=False,
                python=patched_cli(NAN_GRADIENT_FROM_STEP_2))
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    # a run a non-finite streak stopped is evaluated as it ends: its last line says how its accuracy changed
    assert lines[-1].startswith("error: stopped at step 3: 2 consecutive steps skipped (trainer.max_skipped_steps=2), "
                                "the last for a non-finite gradient: lower trainer.lr; no checkpoint to resume from; "
                                f"held-out accuracy: {summary['initial_accuracy']:.3f} before RL -> "
                                f"{summary['final_accuracy']:.3f} after 3 steps")
    assert summary["verdict"] in ("worse", "unchanged")
    assert "set aside the checkpoint of step 1" in lines[-2]  # step 1's update made the weights that failed
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001.suspect"]
    assert (summary["steps"], summary["skipped_steps"]) == (3, 2)
    assert summary["status"].startswith("stopped: 2 consecutive steps skipped")
