"""The reward pool's wire format, shared by the parent (``pool.py``) and the sandboxed worker (``worker.py``).

Parent -> worker: frames of a 4-byte big-endian length and a pickled ``(kind, payload)``: ``("prepare",
[(scorer, setup), ...])``, answered by one line once every setup is built, or ``("score", [(scorer, setup, args,
completion), ...])``, answered by one line per item, in order (pickles travel only from the trusted side).
Worker -> parent: JSON lines ``{"r": reward, "s": status}``, which the receiver checks before believing (a
finite reward in [0, 1], a known status).
"""

from __future__ import annotations

import json
import os
import pickle
import struct
from typing import Any

ANSWER_MAX_BYTES = 256  # a longer line is not an answer


def setup_key(scorer: str, setup: tuple) -> str:
    """The identity of one scorer setup (what a worker must have prepared before scoring with it)."""
    return json.dumps([scorer, list(setup)], sort_keys=True, default=str)


def encode_frame(kind: str, payload: list[Any]) -> bytes:
    body = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack(">I", len(body)) + body


def read_frame(fd: int) -> tuple[str, list[Any]] | None:
    """The next ``(kind, payload)`` from a blocking ``fd``; None at EOF."""
    header = _read_exactly(fd, 4)
    if header is None:
        return None
    body = _read_exactly(fd, struct.unpack(">I", header)[0])
    return None if body is None else pickle.loads(body)


def encode_answer(reward: float, status: str) -> bytes:
    return json.dumps({"r": reward, "s": status}).encode() + b"\n"


def decode_answer(line: bytes, statuses: tuple[str, ...]) -> tuple[float, str]:
    """``(reward, status)`` of one answer line; anything malformed or out of range is ``(0.0, "error")``."""
    try:
        answer = json.loads(line)
        reward, status = float(answer["r"]), answer["s"]
    except (ValueError, KeyError, TypeError):
        return 0.0, "error"
    if status not in statuses or not 0.0 <= reward <= 1.0:
        return 0.0, "error"
    return reward, status


def _read_exactly(fd: int, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)
