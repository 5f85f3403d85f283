"""A guard process that ties a server's whole process tree to the trainer: ``python -m vcpo.guard PARENT_PID GRACE_S
-- COMMAND...`` runs COMMAND in the guard's own process group and ends that group when the trainer asks (SIGTERM) or
dies, ``kill -9`` included. Standard library only, so that it starts in a blink (no torch import).

Why a guard: an inference server is a tree (vLLM's API server, its engine core and workers), and the kernel's
parent-death signal reaches only a direct child. The trainer starts the guard as the leader of a new session with
``PR_SET_PDEATHSIG = SIGTERM`` (``vcpo.runtime.set_parent_death_signal``); the guard survives that signal long
enough to send SIGTERM to its group, wait up to GRACE_S for the server, then SIGKILL the group (itself included).

The guard also removes the shared memory its tree leaves behind. vLLM's processes talk through POSIX shared memory
(``/dev/shm/psm_*`` message queues, ``sem.mp-*`` semaphores) that a process killed before its own cleanup never
unlinks: each one keeps up to a few hundred MB of RAM until the machine restarts. While the server runs, the guard
notes the ``/dev/shm`` names its group maps or holds open (by inode: a semaphore's mapping shows another path);
once the group is dead, it unlinks those that no live process still uses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

SHM_DIR = "/dev/shm"
SCAN_EVERY_S = 1.0  # how often the group's shared memory is noted while the server runs
_stop: list[int] = []


def _request_stop(signum: int, _frame: object) -> None:
    _stop.append(signum)


def group_members(pgid: int) -> list[int]:
    """The live (non-zombie) processes of process group ``pgid``, the caller excluded."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                state, _ppid, group = f.read().rsplit(b")", 1)[1].split()[:3]
        except (OSError, ValueError):  # ended meanwhile
            continue
        if int(group) == pgid and state != b"Z":
            members.append(int(entry.name))
    return members


def _inodes_of(pids: list[int]) -> set[int]:
    """The inodes of the ``/dev/shm`` files that ``pids`` map or hold open."""
    inodes: set[int] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:  # address perms offset device inode path
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith(SHM_DIR + "/"):
                        inodes.add(int(fields[4]))
            for fd in os.scandir(f"/proc/{pid}/fd"):
                if os.readlink(fd.path).startswith(SHM_DIR + "/"):
                    inodes.add(os.stat(fd.path).st_ino)
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return inodes


def shared_memory_of(pids: list[int]) -> set[str]:
    """The ``/dev/shm`` names whose files ``pids`` map or hold open. Matched by inode, not by the path a mapping
    shows: glibc's ``sem_open`` creates and maps a temporary ``sem.XXXXXX``, links it to the semaphore's name and
    unlinks the temporary, so the mapping of ``sem.mp-*`` names a file that no longer exists."""
    inodes = _inodes_of(pids)
    if not inodes:
        return set()
    try:
        return {entry.name for entry in os.scandir(SHM_DIR) if entry.inode() in inodes}
    except OSError:
        return set()


def held_shared_memory() -> set[str]:
    """The ``/dev/shm`` names that some live process maps or holds open."""
    return shared_memory_of([int(e.name) for e in os.scandir("/proc") if e.name.isdigit()])


def remove_orphaned_shared_memory(names: set[str]) -> list[str]:
    """Unlink each of ``names`` that still exists and that no live process maps or holds open; returns those
    removed."""
    removed = []
    for name in sorted(names - held_shared_memory()):
        if "/" in name:
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:  # already gone (its owner's own cleanup), or not ours
            continue
        removed.append(name)
    return removed


def end_group(server: subprocess.Popen, grace_s: float, shared: set[str]) -> None:
    """SIGTERM to the guard's process group (the server tree), up to ``grace_s`` for the server to exit, SIGKILL to
    every other process of the group, the removal of the tree's orphaned shared memory (``shared``, the names it
    was seen to use), then SIGKILL to the group, the guard included: no process of the tree outlives this call."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM is for the server, not the guard
    pgid = os.getpgrp()
    shared |= shared_memory_of(group_members(pgid))
    os.killpg(pgid, signal.SIGTERM)
    try:
        server.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 5.0
    while (members := group_members(pgid)) and time.monotonic() < deadline:
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)
    server.poll()  # reap the server if it was the last one killed
    removed = remove_orphaned_shared_memory(shared)
    if removed:
        print(f"vcpo.guard: removed {len(removed)} shared-memory file(s) the server left in {SHM_DIR}: "
              f"{', '.join(removed)}", file=sys.stderr)
    sys.stderr.flush()
    os.killpg(pgid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m vcpo.guard PARENT_PID GRACE_S -- COMMAND...", file=sys.stderr)
        return 2
    parent_pid, grace_s, command = int(argv[0]), float(argv[1]), argv[3:]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _request_stop)
    if os.getppid() != parent_pid:  # the trainer died before the parent-death signal was armed
        return 1
    server = subprocess.Popen(command)  # inherits the guard's process group, stdout and stderr (the log file)
    shared: set[str] = set()
    next_scan = time.monotonic()
    while not _stop and os.getppid() == parent_pid:  # getppid: a watchdog where the death signal does not apply
        if time.monotonic() >= next_scan:
            shared |= shared_memory_of(group_members(os.getpgrp()))
            next_scan = time.monotonic() + SCAN_EVERY_S
        try:
            code = server.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            continue
        print(f"vcpo.guard: the server exited with code {code}", file=sys.stderr)
        end_group(server, 0.0, shared)  # its children, if any are left
    end_group(server, grace_s, shared)
    return 0  # not reached: the group's SIGKILL ends the guard too


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
