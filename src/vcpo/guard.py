"""A guard process that ties a server's whole process tree to the trainer: ``python -m vcpo.guard PARENT_PID GRACE_S
-- COMMAND...`` runs COMMAND in the guard's own process group and ends that group when the trainer asks (SIGTERM) or
dies, ``kill -9`` included. Standard library only, so that it starts in a blink (no torch import).

Why a guard: an inference server is a tree (vLLM's API server, its engine core and workers), and the kernel's
parent-death signal reaches only a direct child. The trainer starts the guard as the leader of a new session with
``PR_SET_PDEATHSIG = SIGTERM`` (``vcpo.runtime.set_parent_death_signal``); the guard survives that signal long
enough to send SIGTERM to its group, wait up to GRACE_S for the server, then SIGKILL the group (itself included).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

_stop: list[int] = []


def _request_stop(signum: int, _frame: object) -> None:
    _stop.append(signum)


def end_group(server: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the guard's process group (the server tree), up to ``grace_s`` for the server to exit, then
    SIGKILL to the group, the guard included: no process of the tree outlives this call."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM is for the server, not the guard
    os.killpg(os.getpgrp(), signal.SIGTERM)
    try:
        server.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    sys.stderr.flush()
    os.killpg(os.getpgrp(), signal.SIGKILL)


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
    while not _stop and os.getppid() == parent_pid:  # getppid: a watchdog where the death signal does not apply
        try:
            code = server.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            continue
        print(f"vcpo.guard: the server exited with code {code}", file=sys.stderr)
        end_group(server, 0.0)  # its children, if any are left
    end_group(server, grace_s)
    return 0  # not reached: the group's SIGKILL ends the guard too


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
