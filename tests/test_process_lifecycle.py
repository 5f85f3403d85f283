"""Process lifecycle, piece by piece: the first SIGTERM asks the loop to stop and the second forces it, a child
dies with its parent however the parent dies, and a stuck rollout worker (holding its weight lock, or silent
while it holds groups) is an error naming it, never a hang; the async source's checkpoint keeps every group it admitted
and did not train."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
import transformers

from vcpo.errors import RunFailed
from vcpo.loop.signals import ForcedExit, StopRequested, StopSignals
from vcpo.orchestration.async_local import AsyncSource, WorkerSpec, _Worker
from vcpo.types import SamplingParams, Trajectory


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=32)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_the_first_signal_asks_the_second_forces():
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.signum == signal.SIGTERM  # the loop sees it between steps
        with pytest.raises(StopRequested), signals.interruptible():
            pass  # a stop already requested ends an interruptible block at once
        with pytest.raises(ForcedExit):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_child_dies_with_its_parent_however_the_parent_dies(tmp_path):
    pid_file = tmp_path / "child.pid"
    child = (f"import os, time\nfrom vcpo.runtime import die_with_parent\ndie_with_parent({{parent}})\n"
             f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    parent = (f"import os, subprocess, sys, time\ncode = {child!r}.replace('{{parent}}', str(os.getpid()))\n"
              "subprocess.Popen([sys.executable, '-c', code])\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.1)
        child_pid = int(pid_file.read_text())
        proc.kill()  # kill -9: no handler, no cleanup in the parent
        proc.wait()
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{child_pid}") and "Z" not in _state(child_pid):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)
    finally:
        proc.kill()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


class FakeProcess:
    """Stands in for a worker process that is alive but stuck (it never answers) until killed."""

    def __init__(self) -> None:
        self.sentinel_reader, self.sentinel_writer = os.pipe()  # readable once "dead"
        self.exitcode = None

    @property
    def sentinel(self) -> int:
        return self.sentinel_reader

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        self.exitcode = -signal.SIGKILL
        os.write(self.sentinel_writer, b"x")

    def join(self, timeout: float | None = None) -> None:
        pass


def stuck_source(tmp_path, timeout_s: float):
    spec = WorkerSpec(worker_id=0, model_path=str(tmp_path), dtype="float32", device="cpu", lm_head_fp32=False,
                      task_name="chain_sum", task_kwargs={},
                      seed=0, prompts_per_step=2, group_size=2, sampling=SamplingParams(), inflight_updates=False,
                      handoff_timeout_s=timeout_s)
    source = AsyncSource(tiny_llama(), spec, num_workers=1, max_staleness=1, drop_older_than=None, max_restarts=0)
    results, worker_end = multiprocessing.Pipe(duplex=False)
    process = FakeProcess()
    process.tickets_reader, tickets = multiprocessing.Pipe(duplex=False)  # kept open, as a live worker would
    source.workers = [_Worker(process, tickets, results, multiprocessing.Lock())]
    return source, worker_end, process


def test_a_worker_holding_its_weight_lock_past_the_timeout_is_named(tmp_path):
    source, worker_end, process = stuck_source(tmp_path, timeout_s=0.2)
    source.workers[0].lock.acquire()  # the "worker" took its lock and never lets go
    worker_end.close()  # its pipe ends when it is killed
    source.publish(tiny_llama(), 1)  # never hangs: the stuck worker is killed, no restart is allowed
    assert process.exitcode == -signal.SIGKILL
    with pytest.raises(RunFailed, match=r"rollout worker 0 was killed by SIGKILL \(held its weight lock past "
                                        r"async.handoff_timeout_s=0.2\); no restart left"):
        source.next_batch(1)


def test_a_worker_silent_while_it_holds_groups_is_named(tmp_path):
    source, worker_end, _ = stuck_source(tmp_path, timeout_s=0.2)
    source._admit()  # groups 0-3 admitted (k = 1: two steps of 2), all to the one worker, which never answers
    with pytest.raises(RunFailed, match=r"rollout worker 0 sent nothing for [0-9.]+ s while holding 4 group\(s\) "
                                        r"\(async.handoff_timeout_s=0.2\)"):
        source.next_batch(0)
    worker_end.close()


def finished_group(index: int, version: int, length: int) -> list[Trajectory]:
    """Two responses of ``length`` tokens to prompt ``index``, sampled with policy ``version``, rewards 0 and 1."""
    return [Trajectory(problem_uid=f"p{index}", group_id=index, prompt_ids=[1], response_ids=[2] * length,
                       behavior_logprobs=[-1.0] * length, versions=[version] * length, reward=float(i), finished=True,
                       sampling=SamplingParams()) for i in range(2)]


def test_an_async_checkpoint_keeps_every_admitted_group_not_yet_trained(tmp_path):
    source, worker_end, _ = stuck_source(tmp_path, timeout_s=0.2)
    source._admit()  # groups 0-3 admitted at version 0 (k = 1, P = 2), all held by the one worker
    worker_end.send(("group", finished_group(0, 0, 3)))
    worker_end.send(("group", finished_group(1, 0, 4)))
    assert {t.group_id for t in source.next_batch(0)} == {0, 1}
    source.publish(tiny_llama(), 1)  # step 1 done: groups 4, 5 admitted ((1 + 1 + 1) * 2 = 6)
    worker_end.send(("group", finished_group(2, 0, 7)))
    with pytest.raises(RunFailed, match="sent nothing"):  # step 2 ends with one group taken (a signal would too)
        source.next_batch(1)
    worker_end.send(("group", finished_group(4, 1, 5)))  # sent, not yet received
    state = source.state()
    # finished: the abandoned step's group, then the one in the pipe, with their tokens and versions;
    # unfinished: the indices the worker still held
    assert [(g[0]["group_id"], len(g[0]["response_ids"]), g[0]["versions"][0]) for g in state["queued"]] == [
        (2, 7, 0), (4, 5, 1)]
    assert (state["next_group"], state["requeued"]) == (6, [3, 5])
    worker_end.close()

    spec = replace(source.spec, handoff_timeout_s=0.2)
    resumed = AsyncSource(tiny_llama(), spec, num_workers=1, max_staleness=0, drop_older_than=None, start_version=1)
    resumed.load_state(state)
    assert resumed.state() | {"next_group": 0} == state | {"next_group": 0}  # round trip, before any worker starts
    assert resumed.controller.stats.admitted == 1 * 2 + 4  # 2 trained, 4 admitted and not trained
    # Under k = 0 at version 1, group 2 (version 0) is dropped and counted; group 4 is trained; 3 and 5 go first
    results, worker_end = multiprocessing.Pipe(duplex=False)
    _, tickets = multiprocessing.Pipe(duplex=False)
    resumed.workers = [_Worker(FakeProcess(), tickets, results, multiprocessing.Lock())]
    resumed._admit()
    assert resumed.workers[0].held == [3, 5]  # capacity (0 + 1 + 1) * 2 = 4 <= 6 admitted: nothing new
    worker_end.send(("group", finished_group(3, 1, 6)))
    assert [t.group_id for t in resumed.next_batch(1)] == [4, 4, 3, 3]
    assert resumed.metrics()["staleness/dropped_over_bound"] == 1
    worker_end.close()
