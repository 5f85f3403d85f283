"""The agent runner: a child process that runs the user's agent function, one thread per episode.

The agent is user code that may hang or leak threads; in a process of its own it can be killed whatever it does. The
runner dies with its parent (``vcpo.runtime.die_with_parent``) and when its job pipe closes. A sync function runs in
its thread; an async one (or a sync one returning an awaitable) on an event loop of that thread.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from vcpo.agents.task import AgentTaskError
from vcpo.plugins import one_line
from vcpo.types import Problem

_JOIN_S = 5.0
START_TIMEOUT_S = 300.0
"""How long the runner may take to start and import the agent's module (its episodes' deadlines start after)."""


def _run_agent(agent: Any, job: tuple[str, str, str, Problem], results: Connection, lock: threading.Lock) -> None:
    episode_id, base_url, model, problem = job
    try:
        value = agent(base_url, model, problem)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            outcome = ("error", f"returned {value!r}, not a finite number (the reward)")
        else:
            outcome = ("ok", float(value))
    except BaseException as e:  # whatever the agent raises is its episode's failure
        outcome = ("error", f"raised {one_line(e)}")
    with lock:
        try:
            results.send((episode_id, *outcome))
        except OSError:  # the parent closed the pipe: this runner is being stopped
            pass


async def _awaited(value: Any) -> Any:
    return await value


def runner_main(agent_path: str, parent_pid: int, jobs: Connection, results: Connection) -> None:
    """The child's main function: start an episode thread per job until the job pipe closes, then exit at once
    (killing any agent still running)."""
    from vcpo.plugins import load_object
    from vcpo.runtime import die_with_parent

    die_with_parent(parent_pid)
    lock = threading.Lock()
    try:
        agent = load_object(agent_path)
    except Exception as e:
        results.send(("*", "error", f"cannot load the agent: {one_line(e)}"))
        os._exit(1)
    results.send(("*", "ready", None))
    while True:
        try:
            job = jobs.recv()
        except (EOFError, OSError):
            os._exit(0)
        threading.Thread(target=_run_agent, args=(agent, job, results, lock), daemon=True,
                         name=f"vcpo-agent-{job[0]}").start()


class AgentRunner:
    """The parent's handle on the runner process: send episodes, read their outcomes, stop it.

    A plain subprocess, not a multiprocessing child: an async rollout worker is a daemonic process, which may not
    start those. Jobs and outcomes travel as pickles over two pipes of their own (the agent's stdout stays free)."""

    def __init__(self, agent_path: str) -> None:
        job_read, job_write = os.pipe()
        result_read, result_write = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the parent's imports
        self.process = subprocess.Popen(
            [sys.executable, "-m", "vcpo.agents.runner", agent_path, str(os.getpid()), str(job_read),
             str(result_write)], pass_fds=(job_read, result_write), env=env, stdin=subprocess.DEVNULL)
        os.close(job_read)  # the child holds the only other ends: its death reads as end-of-file here
        os.close(result_write)
        self._jobs = Connection(job_write, readable=False)
        self.results = Connection(result_read, writable=False)
        ready = self.results.poll(START_TIMEOUT_S) and self._first_message()
        if ready != ("*", "ready", None):
            self.close()
            reason = ready[2] if ready else f"did not start within {START_TIMEOUT_S:g} s"
            raise AgentTaskError(f"the agent runner for {agent_path!r} {reason}")

    def _first_message(self) -> tuple[str, str, Any] | None:
        try:
            return self.results.recv()
        except (EOFError, OSError):
            return None

    def start(self, episode_id: str, base_url: str, model: str, problem: Problem) -> None:
        self._jobs.send((episode_id, base_url, model, problem))

    def outcomes(self, timeout_s: float) -> list[tuple[str, str, Any]]:
        """The ``(episode_id, "ok" | "error", reward | reason)`` that arrived (waiting up to ``timeout_s``)."""
        out = []
        try:
            while self.results.poll(timeout_s if not out else 0):
                out.append(self.results.recv())
        except (EOFError, OSError):
            pass
        return out

    def alive(self) -> bool:
        return self.process.poll() is None

    @property
    def exit_code(self) -> int | None:
        return self.process.poll()

    def close(self) -> None:
        """Stop the runner and every agent thread in it (a closed job pipe ends it; a kill if it does not)."""
        self._jobs.close()
        try:
            self.process.wait(_JOIN_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(_JOIN_S)
        self.results.close()


if __name__ == "__main__":
    runner_main(sys.argv[1], int(sys.argv[2]), Connection(int(sys.argv[3]), writable=False),
                Connection(int(sys.argv[4]), readable=False))
