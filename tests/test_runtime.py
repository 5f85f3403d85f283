"""The process-wide CPU settings."""

from __future__ import annotations

import sys

import pytest
import torch

from vcpo.runtime import configure_cpu, keep_freed_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_applies_on_glibc_and_is_idempotent():
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True


def test_configure_cpu_sets_threads_and_flushes_denormals():
    before = torch.get_num_threads()
    try:
        configure_cpu(1)
        assert torch.get_num_threads() == 1
        tiny = torch.tensor(1e-30, dtype=torch.float32)
        assert (tiny * 1e-10).item() == 0.0  # 1e-40 is a float32 denormal: flushed to zero
    finally:
        torch.set_num_threads(before)
        torch.set_flush_denormal(False)
