"""The reward pool's worker, running inside the sandbox (``jail.py`` calls :func:`serve` after the privilege drop).

It reads frames of ``(scorer, args, completion)`` items on stdin and answers each item, in order, on stdout
(``protocol.py``). Each frame is scored in a forked child, so what one batch's completions do to the interpreter
(a scorer that ``eval``s them) dies with it; a child that crashes costs only its current item, marked ``crash``,
and the rest go to a new child. The next child is forked ahead (a standby waiting for its frame), so a round trip
pays no fork. Completions of one frame share its child: one that runs code can change how the items after it in
the same frame are scored, never other frames, the worker or the caller.
"""

from __future__ import annotations

import gc
import math
import os
import resource

from vcpo.envs.jail import UID_BASE, kill_quietly, reap_exited
from vcpo.rewards import scorers
from vcpo.rewards.protocol import ANSWER_MAX_BYTES, decode_answer, encode_answer, encode_frame, read_frame


class _Child:
    """A forked scoring process that waits for one frame of items on a private pipe, then answers them."""

    def __init__(self, cpu_s_per_item: int | None) -> None:
        items_r, self.items_w = os.pipe()
        self.answers_r, answers_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self.items_w)
            os.close(self.answers_r)
            _score_frame(items_r, answers_w, cpu_s_per_item)
        os.close(items_r)
        os.close(answers_w)

    def run(self, items: list) -> int:
        """Hand it ``items``; forward its answers to the parent; stop it; return how many it answered."""
        frame = memoryview(encode_frame("score", items))
        try:
            while frame:
                frame = frame[os.write(self.items_w, frame):]
        except BrokenPipeError:  # it died while waiting (a leftover of the last frame killed it)
            pass
        answered, buffer = 0, b""
        while answered < len(items) and len(buffer) <= ANSWER_MAX_BYTES:
            chunk = os.read(self.answers_r, 4096)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer and answered < len(items):
                line, buffer = buffer.split(b"\n", 1)
                _answer(*decode_answer(line, ("ok", "error")))
                answered += 1
        self.stop()
        return answered

    def stop(self) -> None:
        kill_quietly(self.pid)
        os.waitpid(self.pid, 0)
        os.close(self.items_w)
        os.close(self.answers_r)


def _score_frame(items_r: int, answers_w: int, cpu_s_per_item: int | None) -> None:
    """In the child: wait for the frame, score each item, answer on ``answers_w``, exit."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the child never sees the parent's pipes: what it prints goes nowhere
        os.dup2(devnull, fd)
    frame = read_frame(items_r)
    if frame is None:
        os._exit(0)
    items = frame[1]
    if cpu_s_per_item:
        cpu = cpu_s_per_item * len(items)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    me = os.getpid()
    for item in items:
        answer = encode_answer(*_score_one(*item))
        if os.getpid() != me:  # a copy forked inside the scorer (a fork bomb): it must not answer too
            os._exit(0)
        os.write(answers_w, answer)
    os._exit(0)


def serve(args: dict) -> None:
    """Answer frames from stdin until EOF (the parent closed the pipe or died)."""
    cpu = args.get("cpu_s_per_item")
    gc.freeze()  # a forked child's collector then leaves these objects (and their pages) alone: no copying
    standby = _Child(cpu)
    while True:
        frame = read_frame(0)
        if frame is None:
            standby.stop()
            return
        kind, payload = frame
        if kind == "prepare":
            built, status = _prepare(payload)
            if built:  # the standby was forked before: it would lack what was just built
                standby.stop()
                gc.freeze()
                standby = _Child(cpu)
            _answer(0.0, status)
            continue
        done = standby.run(payload)
        while done < len(payload):  # the child died on item `done`: it scores 0, a new child takes the rest
            _answer(0.0, "crash")
            done += 1
            if done < len(payload):
                done += _Child(cpu).run(payload[done:])
        _sweep()
        standby = _Child(cpu)  # forked now, while the parent reads the answers


def _prepare(setups: list[tuple[str, tuple]]) -> tuple[bool, str]:
    """Build each ``(scorer, setup)``; (whether anything new was built, "ok" or "error" if any failed). A setup
    that fails makes its items fail the same way, each reported as an error."""
    built, status = False, "ok"
    for scorer, setup in setups:
        try:
            built |= scorers.prepare(scorer, setup)
        except Exception:
            status = "error"
    return built, status


def _sweep() -> None:
    """Kill whatever a frame's completions started (a fork bomb's survivors) before the next frame.

    Only as the sandbox's own uid (UID_BASE + n), where kill(-1) reaches this sandbox's processes and no
    others; running as the caller's uid (the fallback) it would reach the caller.
    """
    if os.getuid() >= UID_BASE:
        kill_quietly(-1)
        reap_exited()


def _score_one(scorer: str, setup: tuple, args: tuple, completion: str) -> tuple[float, str]:
    try:
        reward = float(scorers.SCORERS[scorer](completion, *setup, *args))
    except BaseException:  # a scorer that raises (or exits) on this completion: 0, counted as an error
        return 0.0, "error"
    if not math.isfinite(reward):
        return 0.0, "error"
    return min(max(reward, 0.0), 1.0), "ok"


def _answer(reward: float, status: str) -> None:
    os.write(1, encode_answer(reward, status))
