"""Parent side of the sandbox: start ``jail.py`` as a jailed process tree, feed it, drain its output under caps,
enforce the wall deadline and kill the whole tree. Shared by :func:`vcpo.envs.sandbox.run_python` and the reward
pool (:mod:`vcpo.rewards.pool`); what the jail isolates, and how, is in ``jail.py`` and docs/sandbox.md.
"""

from __future__ import annotations

import ast
import marshal
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

JAIL_SCRIPT = str(Path(__file__).with_name("jail.py"))
KILL_GRACE_S = 1.0  # how long the jail's supervisor gets to sweep its tree before the process group is killed
EXIT_SETUP = 125  # jail.py's exit status when it could not set the sandbox up


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (never caused by the code it runs); one line saying why."""


@dataclass(frozen=True)
class Limits:
    """Kernel-enforced limits of one sandbox; ``ValueError`` names a field that is out of range."""

    memory_mb: int = 512
    """Address space (RLIMIT_AS) beyond what the interpreter has mapped when the work starts."""
    cpu_s: int | None = None
    """CPU seconds (RLIMIT_CPU: SIGXCPU, SIGKILL one second later); None: only the wall deadline."""
    max_processes: int = 32
    """Processes and threads of the sandbox's own uid (RLIMIT_NPROC)."""
    max_file_mb: int = 16
    """Largest file it may write (RLIMIT_FSIZE)."""
    max_open_files: int = 64
    """RLIMIT_NOFILE."""
    workdir_mb: int = 64
    """Size of the tmpfs working directory (with a mount namespace)."""

    def __post_init__(self) -> None:
        for name, low in (("memory_mb", 16), ("max_processes", 1), ("max_file_mb", 1), ("max_open_files", 8),
                          ("workdir_mb", 1), ("cpu_s", 1)):
            value = getattr(self, name)
            if value is None and name == "cpu_s":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low} (got {value!r})")


@dataclass
class Drained:
    """What one jailed run produced: output (each stream cut at a cap), exit status, deadline, isolation."""

    stdout: bytes = b""
    stderr: bytes = b""
    stdout_cut: int = 0
    stderr_cut: int = 0
    exit_code: int | None = None
    timed_out: bool = False
    report: dict[str, Any] = field(default_factory=dict)


class JailedProcess:
    """One sandboxed process tree started from ``jail.py``, with its own temporary working directory.

    ``payload`` is ``{"kind": "code"}`` (Python source arrives on stdin) or ``{"kind": "call", "target":
    "module:function", "args": {...}}`` (imported from ``read_paths`` before privileges are dropped).
    Safe to use from any thread; each instance belongs to one thread at a time.
    """

    def __init__(self, payload: dict[str, Any], limits: Limits, *, namespaces: bool = True,
                 read_paths: tuple[str, ...] = (), stdout: int = subprocess.PIPE,
                 stderr: int = subprocess.PIPE) -> None:
        self.workdir = tempfile.mkdtemp(prefix="vcpo-sandbox-")
        self.report_fd, report_w = os.pipe()
        spec = {"parent_pid": os.getpid(), "workdir": self.workdir, "namespaces": namespaces,
                "limits": asdict(limits), "payload": payload, "read_paths": list(read_paths), "report_fd": report_w}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", JAIL_SCRIPT, marshal.dumps(spec).hex()], stdin=subprocess.PIPE,
                stdout=stdout, stderr=stderr, env={}, cwd=self.workdir, start_new_session=True, pass_fds=(report_w,),
            )
        except OSError as exc:
            os.close(self.report_fd)
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise SandboxError(f"cannot start the sandbox interpreter {sys.executable}: {exc}") from None
        finally:
            os.close(report_w)
        self._report_buf = bytearray()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_report(self, timeout_s: float) -> dict[str, Any] | None:
        """Block until the jail reports what isolation is in force (None: it died or ``timeout_s`` passed)."""
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.report_fd, selectors.EVENT_READ)
            while b"\n" not in self._report_buf:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sel.select(remaining):
                    return None
                chunk = os.read(self.report_fd, 65536)
                if not chunk:
                    break
                self._report_buf += chunk
        return parse_report(bytes(self._report_buf))

    def kill(self) -> None:
        """Kill the whole tree: SIGTERM lets the supervisor kill init (the PID namespace) or sweep its
        descendants; after a grace period SIGKILL goes to its process group. Returns once it is reaped."""
        if self.proc.poll() is not None:
            return
        pid = self.proc.pid
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        end = time.monotonic() + KILL_GRACE_S
        while time.monotonic() < end:  # WNOWAIT: the pid stays ours (no reuse) until the group is killed
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                break
            time.sleep(0.002)
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()

    def close(self) -> None:
        """Kill what still runs, close the pipes and remove the working directory."""
        self.kill()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        if self.report_fd >= 0:
            os.close(self.report_fd)
            self.report_fd = -1
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> JailedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# CPython before 3.11.8 / 3.12.1 (gh-106905) can raise "SystemError: AST constructor recursion depth mismatch" when
# two threads build ASTs at once, as an agent's concurrent episodes running tools do: one parse at a time.
_AST_LOCK = threading.Lock()


def parse_report(raw: bytes) -> dict[str, Any] | None:
    """The jail's one-line report (a dict literal, written before any untrusted code runs), or None when it sent
    none (or garbage)."""
    try:
        with _AST_LOCK:
            report = ast.literal_eval(raw.split(b"\n", 1)[0].decode())
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
        return None
    return report if isinstance(report, dict) else None


def run_to_end(jail: JailedProcess, stdin: bytes, timeout_s: float, cap_bytes: int) -> Drained:
    """Write ``stdin``, read stdout, stderr and the report until the tree exits or ``timeout_s`` passes.

    Output beyond ``cap_bytes`` per stream is read and dropped (counted in ``*_cut``), so a program that
    prints without end neither blocks nor fills memory. At the deadline the whole tree is killed.
    """
    out = Drained()
    deadline = time.monotonic() + timeout_s
    bufs = {jail.proc.stdout.fileno(): bytearray(), jail.proc.stderr.fileno(): bytearray(), jail.report_fd: bytearray()}
    cut = dict.fromkeys(bufs, 0)
    pending = memoryview(stdin)
    stdin_fd = jail.proc.stdin.fileno()
    os.set_blocking(stdin_fd, False)
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        sel.register(stdin_fd, selectors.EVENT_WRITE)
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if out.timed_out:  # something escaped the kill and holds a pipe: stop waiting for it
                    break
                out.timed_out = True
                jail.kill()
                deadline = time.monotonic() + KILL_GRACE_S
                continue
            for key, _ in sel.select(remaining):
                fd = key.fd
                if fd == stdin_fd:
                    try:
                        pending = pending[os.write(fd, pending[:65536]):]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(fd)
                        jail.proc.stdin.close()
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    sel.unregister(fd)
                    continue
                room = (cap_bytes if fd != jail.report_fd else 65536) - len(bufs[fd])
                bufs[fd] += chunk[: max(room, 0)]
                cut[fd] += max(len(chunk) - max(room, 0), 0)
    if not out.timed_out:
        try:
            jail.proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            out.timed_out = True
    jail.kill()
    out.stdout, out.stderr = bytes(bufs[jail.proc.stdout.fileno()]), bytes(bufs[jail.proc.stderr.fileno()])
    out.stdout_cut, out.stderr_cut = cut[jail.proc.stdout.fileno()], cut[jail.proc.stderr.fileno()]
    out.exit_code = None if out.timed_out else jail.proc.returncode
    out.report = parse_report(bytes(bufs[jail.report_fd])) or {}
    return out
