"""The three ways a command ends early, torch-free so the command line can catch them before any heavy import.

``vcpo`` exits 2 on a ``UserError`` (nothing started, or a disk that refused a write), 1 on ``RunFailed``
(training began and cannot go on), 3 on ``HealthAlarm`` (a health alarm stopped the run) and 128 + signal on
``RunInterrupted`` (SIGTERM 143, SIGINT 130).
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path


class UserError(Exception):
    """A problem the user can fix (config, path, disk); its message is one line naming the culprit."""


class RunFailed(Exception):
    """Training started but cannot go on (non-finite steps, rollout workers dying, a stalled weight
    handoff); the trainer checkpointed the last finished step before raising it."""


class HealthAlarm(RunFailed):
    """A health alarm stopped the run (``trainer.on_alarm: stop``, or ``rollback`` out of retries); the trainer kept
    the checkpoint of the last step no rule flagged. Exit status ``EXIT_CODE``."""

    EXIT_CODE = 3


class RunInterrupted(Exception):
    """SIGTERM or SIGINT stopped the run; ``signum`` is the signal, the exit status is 128 + signum."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class DiskError(UserError):
    """A write the file system refused (read-only, full, no permission); names the path.

    Build it before cleaning up after the failed write: when the library's error carries no errno (torch's
    "unexpected pos" on a full disk), the reason is read from the file system itself, which the cleanup changes.
    """

    def __init__(self, path: str | Path, error: BaseException) -> None:
        super().__init__(f"cannot write {str(path)!r}: {_reason(Path(path), error)}")


def _reason(path: Path, error: BaseException) -> str:
    if isinstance(error, OSError) and error.errno:
        return os.strerror(error.errno)
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        fs = os.statvfs(probe)
    except OSError:
        fs = None
    if fs is not None and fs.f_flag & os.ST_RDONLY:
        return os.strerror(errno.EROFS)
    if fs is not None and fs.f_bavail * fs.f_frsize < _NEARLY_FULL_BYTES:
        return os.strerror(errno.ENOSPC)
    return " ".join(str(error).split())[:200] or type(error).__name__


_NEARLY_FULL_BYTES = 1 << 20
