"""``run_python``: run untrusted Python (a tool call, a model's program) in a fresh sandboxed process (API.md §5).

The isolation (namespaces, read-only filesystem, unprivileged uid, Landlock, rlimits, whole-tree kill) lives in
:mod:`vcpo.envs.isolation` and ``jail.py``; docs/sandbox.md lists what is isolated, how, and the fallback.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from vcpo.envs.isolation import EXIT_SETUP, JailedProcess, Limits, SandboxError, run_to_end

DEFAULT_OUTPUT_LIMIT_BYTES = 64 * 1024


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run produced.

    ``exit_code`` is the program's exit status (negative: killed by that signal, e.g. -9 by RLIMIT_CPU's
    hard limit) or None when the wall deadline killed it (``timed_out``). ``isolation`` names the layers
    that were in force, e.g. ``("pid-namespace", "net-namespace", ..., "unprivileged-uid", "rlimits")``.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    duration_s: float = 0.0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    isolation: tuple[str, ...] = ()


def run_python(
    code: str,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    *,
    cpu_s: int | None = None,
    max_processes: int = 32,
    max_file_mb: int = 16,
    max_open_files: int = 64,
    output_limit_bytes: int = DEFAULT_OUTPUT_LIMIT_BYTES,
    namespaces: bool = True,
) -> SandboxResult:
    """Run ``code`` as ``__main__`` of a fresh, isolated Python process and return its output.

    The process starts from an empty environment in its own temporary working directory (a private tmpfs,
    removed afterwards), reads EOF on stdin, has no network and sees the rest of the filesystem read-only,
    as an unprivileged uid of its own, under the limits (``memory_mb`` of address space, ``cpu_s`` CPU
    seconds, default ``ceil(timeout_s)``, ``max_processes``, ``max_file_mb``, ``max_open_files``). After
    ``timeout_s`` seconds of wall time (interpreter start-up included) its whole process tree is killed.
    stdout and stderr are each cut at ``output_limit_bytes``. Only the standard library is importable.

    ``namespaces=False`` skips the Linux namespaces (what a machine without them gets; see docs/sandbox.md
    for what is then not blocked); ``isolation`` in the result always says what was in force.

    Never raises for anything the code does. Raises ``ValueError`` for invalid arguments and
    :class:`~vcpo.envs.isolation.SandboxError` when the sandbox itself cannot be set up.
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a str (got {type(code).__name__})")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s <= 3600:
        raise ValueError(f"timeout_s must be a number in (0, 3600] (got {timeout_s!r})")
    if isinstance(output_limit_bytes, bool) or not isinstance(output_limit_bytes, int) or output_limit_bytes < 0:
        raise ValueError(f"output_limit_bytes must be an integer >= 0 (got {output_limit_bytes!r})")
    limits = Limits(memory_mb=memory_mb, cpu_s=math.ceil(timeout_s) if cpu_s is None else cpu_s,
                    max_processes=max_processes, max_file_mb=max_file_mb, max_open_files=max_open_files)
    start = time.perf_counter()
    with JailedProcess({"kind": "code"}, limits, namespaces=bool(namespaces)) as jail:
        out = run_to_end(jail, code.encode("utf-8", "surrogatepass"), timeout_s, output_limit_bytes)
    if out.report.get("error") or (out.exit_code == EXIT_SETUP and not out.report):
        raise SandboxError(out.report.get("error") or f"the sandbox exited before starting: {out.stderr[-300:]!r}")
    return SandboxResult(
        stdout=out.stdout.decode("utf-8", "replace"),
        stderr=out.stderr.decode("utf-8", "replace"),
        exit_code=out.exit_code,
        timed_out=out.timed_out,
        duration_s=time.perf_counter() - start,
        stdout_truncated=out.stdout_cut > 0,
        stderr_truncated=out.stderr_cut > 0,
        isolation=tuple(out.report.get("isolation", ())),
    )
