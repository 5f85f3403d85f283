"""Process-wide settings that every vcpo process (learner, rollout worker, benchmark) applies alike: CPU threads,
denormals and the allocator, the device a config names, and, for child processes, dying with their parent."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import torch

from vcpo.config import ConfigError

_PR_SET_PDEATHSIG = 1  # linux/prctl.h

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks for reuse instead of returning them to the OS; returns whether it applied.

    PyTorch has no caching allocator on the CPU: every activation is a fresh malloc. With glibc's defaults,
    blocks of a megabyte or more are mmap'ed and unmapped on free, so each step page-faults its working set
    back in; a step that keeps more activations alive (the fast OPOB capture) pays it most. Measured on the
    2-core VM (default model, thread time, with other jobs running): the fast VCPO learner step went from
    about 1.25x to 1.19x a GRPO step with it.
    A no-op (False) off Linux/glibc. The price: the process keeps its peak heap instead of shrinking.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    # 32 MiB is glibc's largest mmap threshold on 64-bit; trimming only above 1 GiB of free heap.
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def configure_cpu(threads: int) -> None:
    """Intra-op threads, flushed denormals and the allocator setting, for any process that runs models."""
    torch.set_num_threads(threads)
    # Tiny importance weights at high staleness make tiny gradient terms; as denormal floats they run
    # 10-100x slower on CPUs (measured: 27 s instead of 1.6 s for one OPOB gradient assembly).
    torch.set_flush_denormal(True)
    keep_freed_memory()


def _find_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # not glibc
        return None


_PRCTL = _find_prctl()  # looked up once here: a preexec_fn (below) should not load libraries between fork and exec


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) dies; Linux only, returns whether
    it applied. As ``preexec_fn`` of a ``subprocess.Popen`` it runs in the child and survives its ``exec``."""
    return _PRCTL is not None and _PRCTL(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0


def die_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
    """End this process when ``parent_pid`` ends, however it ends (``kill -9`` included).

    On Linux the kernel sends SIGKILL at the parent's death (``PR_SET_PDEATHSIG``; it follows the parent
    *thread* that started this process, so start children from the main thread). If the parent died before
    the request took effect, this exits at once; a watchdog thread polling the parent id covers platforms
    without prctl (the parent's death re-parents this process).
    """
    set_parent_death_signal()  # where it does not apply, the watchdog still covers it
    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid, poll_s), daemon=True, name="vcpo-parent-watchdog").start()


def _watch_parent(parent_pid: int, poll_s: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    os._exit(1)


def resolve_device(spec: str) -> torch.device:
    """The torch device of ``model.device``: ``auto`` is ``cuda`` when CUDA is available, else ``cpu``.

    A CUDA device that this machine does not have is a ``ConfigError`` naming the key."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"model.device={spec!r}: CUDA is not available on this machine (use auto or cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"model.device={spec!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device
