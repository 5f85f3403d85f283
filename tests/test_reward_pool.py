"""The sandboxed scoring pool and the task reward path through it: order, statuses and counts, deadlines,
crashes, hostile completions through the reasoning-gym scorers that ``eval`` them, threads, and no leftovers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from vcpo.config import TaskConfig
from vcpo.envs.jail import UID_BASE
from vcpo.rewards import RewardOutcome, ScoreRequest, ScoringPool, shared_pool
from vcpo.tasks import make_task
from vcpo.types import Problem

HANG = "any(iter(int, 1))"  # eval'd by string_insertion's scorer: loops forever on 0s, allocating nothing


@pytest.fixture(scope="module")
def insertion():
    """string_insertion evals any answer that is not exactly right; 0.1 when eval(...) joins to the answer."""
    task = make_task(TaskConfig(name="string_insertion", kwargs={}, reward_timeout_s=1.0))
    return task, task.problems("train", 1, seed=0)[0]


def oracle_if(problem: Problem, condition: str) -> str:
    """A completion that string_insertion scores 0.1 exactly when ``condition`` holds inside the scorer: a way
    to ask the sandbox a yes/no question and read the answer back through the reward."""
    return f"list({problem.answer!r}) if ({condition}) else []"


def sandbox_uid_processes(pool: ScoringPool) -> list[int]:
    """Processes running as one of the pool's sandbox uids (UID_BASE + each worker's supervisor pid)."""
    uids = {UID_BASE + w.jail.pid for w in pool._all if w.jail is not None}
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid in uids:
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_scores_a_batch_in_order_and_counts_statuses():
    task = make_task(TaskConfig())
    problems = task.problems("eval", 6, seed=1)
    pool = shared_pool(task.reward_workers)
    before = pool.counts()
    outcomes = task.score(problems, [p.answer if i % 2 == 0 else "nope" for i, p in enumerate(problems)])
    assert [o.reward for o in outcomes] == [1.0, 0.0] * 3
    requests = [ScoreRequest("no_such_scorer", (), "x"), ScoreRequest("math", ("7",), "so it is 7")]
    assert pool.score(requests) == [RewardOutcome(0.0, "error"), RewardOutcome(1.0, "ok")]
    after = pool.counts()
    assert after["ok"] - before["ok"] == 7 and after["error"] - before["error"] == 1


def test_hang_is_cut_and_the_rest_of_the_batch_is_scored(insertion):
    task, problem = insertion
    task.reward(problem, problem.answer)  # a warm worker, so the clock below measures the deadline only
    start = time.perf_counter()
    outcomes = task.score([problem] * 3, [problem.answer, HANG, problem.answer])
    assert [o.status for o in outcomes] == ["ok", "timeout", "ok"]
    assert [o.reward for o in outcomes] == [1.0, 0.0, 1.0]
    assert time.perf_counter() - start < 1.0 + 60  # the deadline, then a fresh worker for the third item


@pytest.mark.parametrize("exit_call", [
    "__import__('os')._exit(0)", "__import__('os').kill(__import__('os').getpid(), 9)", "__import__('sys').exit(3)",
])
def test_a_crash_or_exit_costs_only_its_own_item(insertion, exit_call):
    task, problem = insertion
    outcomes = task.score([problem] * 3, [problem.answer, exit_call, problem.answer])
    assert outcomes[1].reward == 0.0 and outcomes[1].status in ("crash", "error")  # sys.exit: SystemExit
    assert [outcomes[0].reward, outcomes[2].reward] == [1.0, 1.0]


@pytest.mark.parametrize("name", ["string_insertion", "n_queens", "spiral_matrix", "binary_matrix"])
def test_shell_commands_from_each_eval_ing_task_stay_inside(name):
    task = make_task(TaskConfig(name=name, kwargs={}, reward_timeout_s=5.0))
    problem = task.problems("train", 1, seed=0)[0]
    marker = f"/tmp/vcpo-pwned-{uuid.uuid4().hex}"
    payload = f"__import__('os').system('touch {marker}; echo hi > {marker}.2')"
    assert task.reward(problem, payload) == 0.0
    assert not os.path.exists(marker) and not os.path.exists(marker + ".2")
    assert task.reward(problem, problem.answer) == 1.0  # and scoring goes on


def test_hostile_completions_are_contained_and_scoring_continues(insertion, tmp_path):
    task, problem = insertion
    accepted: list[socket.socket] = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        outside = tmp_path / "written-by-a-completion"
        payloads = {
            "file write": f"open({str(outside)!r}, 'w').write('x')",
            "shell": f"__import__('subprocess').run('echo x > {outside}.sh', shell=True)",
            "network": f"__import__('socket').create_connection(('127.0.0.1', {port}), timeout=2)",
            "memory bomb": "' ' * 10**11",
            "infinite loop": HANG,
        }
        outcomes = task.score([problem] * len(payloads), list(payloads.values()))
        try:
            accepted.append(server.accept()[0])
        except BlockingIOError:
            pass
    assert accepted == [] and not outside.exists() and not (tmp_path / "written-by-a-completion.sh").exists()
    assert all(o.reward == 0.0 for o in outcomes)
    assert outcomes[-1].status == "timeout"
    assert task.reward(problem, problem.answer) == 1.0


INSIDE = {  # question -> a condition that holds inside the scorer exactly when the answer is yes
    "nothing of the caller's environment": "not {'VCPO_TEST_SECRET', 'PATH', 'HOME'} & set(__import__('os').environ)",
    "an unprivileged uid of its own": f"__import__('os').getuid() >= {UID_BASE}",
    "no network": "all(n == 'lo' for _, n in __import__('socket').if_nameindex())",
    "the caller's files are read-only": "not __import__('os').access('/tmp', __import__('os').W_OK)",
}


def test_what_the_scorer_sees_from_inside(insertion, monkeypatch):
    task, problem = insertion
    monkeypatch.setenv("VCPO_TEST_SECRET", "hunter2")
    pool = ScoringPool(1)  # started after the secret was set
    try:
        requests = [ScoreRequest("reasoning_gym", (problem.metadata["entry"],), oracle_if(problem, condition),
                                 setup=(task.name, task.kwargs)) for condition in INSIDE.values()]
        answers = dict(zip(INSIDE, (o.reward == 0.1 for o in pool.score(requests)), strict=True))
    finally:
        pool.close()
    if os.geteuid() != 0:  # a dedicated uid needs root (docs/sandbox.md)
        answers.pop("an unprivileged uid of its own")
    assert all(answers.values()), answers


def test_a_fork_bomb_is_capped_and_swept_after_its_batch(insertion):
    task, problem = insertion
    bomb = "[__import__('os').fork() for _ in range(64)]"
    outcomes = task.score([problem] * 2, [bomb, HANG])
    assert outcomes[0].reward == 0.0
    assert outcomes[1].status == "timeout"  # the bomb's copies did not answer for the items after it
    assert task.reward(problem, problem.answer) == 1.0
    pool = shared_pool(task.reward_workers)
    time.sleep(0.2)
    assert len(sandbox_uid_processes(pool)) <= 2 * pool.workers  # per worker: itself and its standby scorer


def test_many_threads_at_once():
    task = make_task(TaskConfig())
    problems = task.problems("eval", 40, seed=3)
    results: dict[int, list[float]] = {}

    def one(i: int) -> None:
        chunk = problems[i * 5 : (i + 1) * 5]
        results[i] = [o.reward for o in task.score(chunk, [p.answer if i % 2 else "0" for p in chunk])]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, rewards in results.items():
        expected = [1.0] * 5 if i % 2 else [float(p.answer == "0") for p in problems[i * 5 : (i + 1) * 5]]
        assert rewards == expected
    assert len(results) == 8


def test_workers_die_with_their_parent_and_leave_nothing(tmp_path):
    """A process that scores then is SIGKILLed: its workers' trees go too, and their working directories. (The
    pool holds no shared memory; /dev/shm is shared with whatever else runs here, so it is checked by hand.)"""
    script = ("import sys, time\nfrom vcpo.rewards import ScoringPool, ScoreRequest\npool = ScoringPool(2)\n"
              "pool.score([ScoreRequest('math', ('1',), '1'), ScoreRequest('math', ('2',), '2')])\n"
              "print(*[w.jail.pid for w in pool._all], flush=True)\n"
              "print(*[w.jail.workdir for w in pool._all], flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        supervisors = [int(p) for p in proc.stdout.readline().split()]
        workdirs = proc.stdout.readline().split()
        uids = {UID_BASE + p for p in supervisors}
        assert len(supervisors) == 2 and all(os.path.exists(f"/proc/{p}") for p in supervisors)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    def left() -> list[str]:  # the supervisors, and everything that ran as the workers' uids
        return [p for p in filter(str.isdigit, os.listdir("/proc"))
                if (_uid(p) in uids or int(p) in supervisors) and _alive(int(p))]

    deadline = time.monotonic() + 10  # the kernel tears the trees down after their parent, not at once
    while time.monotonic() < deadline and left():
        time.sleep(0.05)
    assert left() == []
    assert not any(os.path.exists(d) for d in workdirs)  # the supervisors removed them on their way out


def test_close_stops_everything():
    pool = ScoringPool(1)
    assert pool.score([ScoreRequest("math", ("2",), "2")])[0].reward == 1.0
    supervisor = pool._all[0].jail.pid
    pool.close()
    assert not _alive(supervisor)
    with pytest.raises(RuntimeError, match="after close"):
        pool.score([ScoreRequest("math", ("2",), "2")])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _uid(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def test_the_fallback_without_namespaces_scores_and_cuts_hangs(insertion):
    task, problem = insertion
    pool = ScoringPool(1, namespaces=False)
    try:
        requests = [ScoreRequest("reasoning_gym", (problem.metadata["entry"],), c, setup=(task.name, task.kwargs))
                    for c in (problem.answer, HANG, problem.answer)]
        outcomes = pool.score(requests, timeout_s=1.0)
        assert [(o.reward, o.status) for o in outcomes] == [(1.0, "ok"), (0.0, "timeout"), (1.0, "ok")]
        assert "pid-namespace" not in pool._all[0].isolation and "rlimits" in pool._all[0].isolation
    finally:
        pool.close()
