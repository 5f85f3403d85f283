"""SIGTERM and SIGINT as a request to stop: the loop finishes or abandons the current step, checkpoints the
last finished one and exits; a second signal exits at once. Schedulers send SIGTERM before preemption.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType

from vcpo.errors import signal_name

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(BaseException):
    """Raised inside an ``interruptible()`` block by the first signal: the work there may be abandoned.
    A BaseException, like KeyboardInterrupt, so that no `except Exception` swallows it."""


class ForcedExit(BaseException):
    """Raised by a second signal wherever the loop is: exit now, without a checkpoint."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopSignals:
    """Installs the handlers for its ``with`` block (main thread only; elsewhere it only never fires).

    The first SIGTERM/SIGINT sets ``signum`` and says so on stderr; the loop polls ``signum`` between
    steps. Inside ``interruptible()`` (waiting for rollouts, which a resume regenerates) it also raises
    ``StopRequested`` so that the wait ends now. A second signal raises ``ForcedExit`` anywhere.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._interruptible = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise ForcedExit(signum)
        self.signum = signum
        # os.write, not print: the handler may run in the middle of another write to stderr.
        os.write(2, f"received {signal_name(signum)}: stopping, the last finished step checkpointed "
                    f"(send it again to exit at once)\n".encode())
        if self._interruptible:
            raise StopRequested

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """A block that the first signal may cut short with ``StopRequested``."""
        if self.signum is not None:
            raise StopRequested
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False
