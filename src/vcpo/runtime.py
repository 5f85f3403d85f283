"""Process-wide settings that every vcpo process (learner, rollout worker, benchmark) applies alike: CPU threads,
denormals and the allocator, and the device a config names."""

from __future__ import annotations

import ctypes
import sys

import torch

from vcpo.config import ConfigError

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
