"""The reward pool's worker, running inside the sandbox (``jail.py`` calls :func:`serve` after the privilege drop).

It reads frames of ``(scorer, args, completion)`` items on stdin and answers each item, in order, on stdout
(``protocol.py``). Each frame is scored in a forked child, so what one batch's completions do to the interpreter
(a scorer that ``eval``s them) dies with it; a child that crashes costs only its current item, marked ``crash``,
and the rest go to a new child. Completions of one frame share that child: one that runs code can change how
the items after it in the same frame are scored, never other frames, the worker or the caller.
"""

from __future__ import annotations

import math
import os
import resource
import signal

from vcpo.envs.jail import UID_BASE
from vcpo.rewards import scorers
from vcpo.rewards.protocol import ANSWER_MAX_BYTES, decode_answer, encode_answer, read_frame


def serve(args: dict) -> None:
    """Answer frames from stdin until EOF (the parent closed the pipe or died)."""
    scorers.quiet()
    while True:
        items = read_frame(0)
        if items is None:
            return
        for scorer, scorer_args, _ in items:
            try:
                scorers.prepare(scorer, scorer_args)
            except Exception:  # the item's own scoring fails the same way and reports it
                pass
        done = 0
        while done < len(items):
            done += _score_in_child(items[done:], args.get("cpu_s_per_item"))
            if done < len(items):  # the child died on item `done`
                _answer(0.0, "crash")
                done += 1
        _sweep()


def _sweep() -> None:
    """Kill whatever a frame's completions started (a fork bomb's survivors) before the next frame.

    Only as the sandbox's own uid (UID_BASE + n), where kill(-1) reaches this sandbox's processes and no
    others; running as the caller's uid (the fallback) it would reach the caller.
    """
    if os.getuid() < UID_BASE:
        return
    try:
        os.kill(-1, signal.SIGKILL)  # every process this uid may signal, except the caller of kill()
    except ProcessLookupError:
        pass
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _score_in_child(items: list, cpu_s_per_item: int | None) -> int:
    """Fork a child that scores ``items`` in order; forward its answers; return how many it answered."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # the child never sees the parent's pipes: what it prints goes nowhere
            os.dup2(devnull, fd)
        if cpu_s_per_item:
            cpu = cpu_s_per_item * len(items)
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        me = os.getpid()
        for scorer, scorer_args, completion in items:
            answer = encode_answer(*_score_one(scorer, scorer_args, completion))
            if os.getpid() != me:  # a copy forked inside the scorer (a fork bomb): it must not answer too
                os._exit(0)
            os.write(write_end, answer)
        os._exit(0)
    os.close(write_end)
    answered, buffer = 0, b""
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        while answered < len(items):
            chunk = pipe.read(4096)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer and answered < len(items):
                line, buffer = buffer.split(b"\n", 1)
                _answer(*decode_answer(line, ("ok", "error")))
                answered += 1
            if len(buffer) > ANSWER_MAX_BYTES:
                break
    if answered < len(items):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    os.waitpid(pid, 0)
    return answered


def _score_one(scorer: str, args: tuple, completion: str) -> tuple[float, str]:
    try:
        reward = float(scorers.SCORERS[scorer](completion, *args))
    except BaseException:  # a scorer that raises (or exits) on this completion: 0, counted as an error
        return 0.0, "error"
    if not math.isfinite(reward):
        return 0.0, "error"
    return min(max(reward, 0.0), 1.0), "ok"


def _answer(reward: float, status: str) -> None:
    os.write(1, encode_answer(reward, status))
