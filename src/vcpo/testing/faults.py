"""Watching a `vcpo train` process from the outside, for fault injection: its descendants (rollout workers,
the resource tracker), the shared-memory segments they map, waiting for metric lines and for processes to go.

Linux only (it reads /proc). Everything waits with a deadline and raises ``TimeoutError`` naming what it waited for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from vcpo.guard import shared_memory_of
from vcpo.runtime import set_parent_death_signal

SHM = "/dev/shm/"


def command_env() -> dict[str, str]:
    """The environment a test or benchmark runs `vcpo` in: offline, one thread per process."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def start_train(args: list[str], log: Path, cwd: Path) -> subprocess.Popen:
    """``vcpo train ARGS`` with stdout and stderr in ``log``, in its own session (so that ``os.killpg`` reaches
    all of it), killed if the caller dies (a test or benchmark killed mid-way leaves no run behind)."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "vcpo.cli", "train", *args], cwd=cwd, stdout=out,
                                stderr=subprocess.STDOUT, env=command_env(), start_new_session=True,
                                preexec_fn=set_parent_death_signal)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a live process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None and stat[0] not in ("Z", "X"):
            parents[int(entry)] = stat[1]
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def worker_pids(trainer_pid: int, timeout_s: float = 120) -> list[int]:
    """The rollout worker processes of a trainer (not its resource tracker), waiting until there is one."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = [p for p in descendants(trainer_pid) if "spawn_main" in _cmdline(p)]
        if workers:
            return workers
        if time.monotonic() > deadline or not alive(trainer_pid):
            raise TimeoutError(f"no rollout worker under process {trainer_pid}")
        time.sleep(0.05)


def shm_segments(pids: list[int]) -> set[str]:
    """The named files under /dev/shm that these processes map or hold open, matched by inode (see
    ``vcpo.guard.shared_memory_of``): a multiprocessing lock counts from its creation in the trainer, not only once a
    (re)started worker has opened it by name."""
    return {SHM + name for name in shared_memory_of(pids)}


def wait_gone(pids: list[int], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while left := [p for p in pids if alive(p)]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {left} outlived their trainer by {timeout_s:g} s")
        time.sleep(0.05)


def line_count(path: Path) -> int:
    try:
        return Path(path).read_bytes().count(b"\n")
    except OSError:
        return 0


def wait_for_lines(path: Path, n: int, proc, timeout_s: float = 300) -> None:
    """Until ``path`` holds ``n`` complete lines; ``proc`` (a Popen) must still be running meanwhile."""
    deadline = time.monotonic() + timeout_s
    while line_count(path) < n:
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (status {proc.returncode}) before {path} had {n} lines")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not reach {n} lines in {timeout_s:g} s")
        time.sleep(0.05)
