"""`vcpo.guard`, the process that ties a launched server's tree to the trainer: on SIGTERM it ends the whole tree,
a child that ignores SIGTERM included, and unlinks the /dev/shm files the tree left (what vLLM's killed processes
leave: issue 25), but never one that a process outside the tree still holds."""

from __future__ import annotations

import _multiprocessing
import mmap
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import processes_with

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")

# A stand-in for a server tree: the server maps one shared-memory file and forks a worker that maps another, creates
# a named semaphore (as multiprocessing's spawn context does: glibc maps it under a temporary name, so only its inode
# ties the mapping to the file) and ignores SIGTERM (as a busy engine core can); both also open the file the test
# holds; then they wait for their end.
SERVER = """
import _multiprocessing, mmap, os, signal, sys, time
def hold(name):
    fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    return fd, mmap.mmap(fd, 4096)
mine = hold(sys.argv[1])
shared = os.open("/dev/shm/" + sys.argv[3], os.O_RDWR)
if os.fork() == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    worker = hold(sys.argv[2])
    semaphore = _multiprocessing.SemLock(1, 1, 1, "/" + sys.argv[5] + "-sem", False)  # kind, value, max, name, unlink
    open(sys.argv[4], "w").close()
    time.sleep(120)
    os._exit(0)
time.sleep(120)
"""


def test_the_guard_ends_the_tree_and_removes_only_its_orphaned_shared_memory(tmp_path):
    tag = f"vcpo-test-{uuid.uuid4().hex[:12]}"
    server_shm, worker_shm, kept_shm = f"{tag}-server", f"{tag}-worker", f"{tag}-kept"
    semaphore = f"sem.{tag}-sem"  # the file of the POSIX semaphore named /{tag}-sem
    kept_fd = os.open(SHM / kept_shm, os.O_CREAT | os.O_RDWR, 0o600)  # the test's: held outside the tree
    ready = tmp_path / "ready"
    guard = subprocess.Popen([sys.executable, "-m", "vcpo.guard", str(os.getpid()), "0.5", "--", sys.executable,
                              "-c", SERVER, server_shm, worker_shm, kept_shm, str(ready), tag],
                             start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert guard.poll() is None and time.monotonic() < deadline, guard.stderr.read()
            time.sleep(0.05)
        time.sleep(1.5)  # at least one of the guard's scans (every second) sees the worker's file
        assert (SHM / server_shm).exists() and (SHM / worker_shm).exists() and (SHM / semaphore).exists()
        assert len(processes_with(tag)) == 3  # the guard, the server and its worker
        guard.send_signal(signal.SIGTERM)
        assert guard.wait(timeout=20) == -signal.SIGKILL  # the guard's last act: SIGKILL to its own group
        assert processes_with(tag) == []  # the worker that ignored SIGTERM included
        assert not (SHM / server_shm).exists() and not (SHM / worker_shm).exists()
        assert not (SHM / semaphore).exists()  # what a killed vLLM worker left in a CI run (mapped as sem.XXXXXX)
        assert (SHM / kept_shm).exists()  # still held by this process: not the tree's to remove
        assert (f"removed 3 shared-memory file(s) the server left in /dev/shm: {semaphore}, {server_shm}, {worker_shm}"
                in guard.stderr.read())
    finally:
        if guard.poll() is None:
            os.killpg(guard.pid, signal.SIGKILL)
        for pid in processes_with(tag):
            os.kill(pid, signal.SIGKILL)
        os.close(kept_fd)
        for name in (server_shm, worker_shm, kept_shm, semaphore):
            (SHM / name).unlink(missing_ok=True)
        guard.stderr.close()


def test_the_guard_scans_only_its_group_and_a_mapping_names_its_file(tmp_path):
    from vcpo.guard import group_members, shared_memory_of

    name = f"vcpo-test-{uuid.uuid4().hex[:12]}"
    fd = os.open(SHM / name, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 4096)
        mapped = mmap.mmap(fd, 4096)
        assert name in shared_memory_of([os.getpid()])
        assert os.getpid() not in group_members(os.getpgrp())  # the caller is never its own target
        mapped.close()
        semaphore = _multiprocessing.SemLock(1, 1, 1, f"/{name}", False)  # its mapping shows sem.XXXXXX (deleted)
        assert f"sem.{name}" in shared_memory_of([os.getpid()])
        del semaphore
    finally:
        os.close(fd)
        (SHM / name).unlink()
        (SHM / f"sem.{name}").unlink(missing_ok=True)
