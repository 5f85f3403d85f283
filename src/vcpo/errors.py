"""The three ways a command ends early, torch-free so the command line can catch them before any heavy import.

``vcpo`` exits 2 on a ``UserError`` (nothing started, or a disk that refused a write), 1 on ``RunFailed``
(training began and cannot go on) and 128 + signal on ``RunInterrupted`` (SIGTERM 143, SIGINT 130).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


class UserError(Exception):
    """A problem the user can fix (config, path, disk); its message is one line naming the culprit."""


class RunFailed(Exception):
    """Training started but cannot go on (non-finite steps, rollout workers dying, a stalled weight
    handoff); the trainer checkpointed the last finished step before raising it."""


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
    """A write the file system refused (read-only, full, no permission); names the path."""

    def __init__(self, path: str | Path, error: BaseException) -> None:
        reason = os.strerror(error.errno) if isinstance(error, OSError) and error.errno else _one_line(error)
        super().__init__(f"cannot write {str(path)!r}: {reason}")


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
