"""A CPU platform for verl 0.9.1, which registers CUDA, ROCm and NPU only and otherwise falls back to CUDA: with it
installed (``set_platform``) verl's FSDP engine builds its device mesh, moves its model and runs on the CPU, with
gloo for its collectives. Test scaffolding of the verl tier, not part of vcpo."""

from __future__ import annotations

import contextlib
from types import ModuleType

import torch
from verl.plugin.platform.platform_base import PlatformBase


class CPUPlatform(PlatformBase):
    """verl's device interface answered for the CPU (``torch.cpu``): one device, no allocator or profiler."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module: ModuleType = torch.cpu

    def is_available(self) -> bool:
        return True

    def current_device(self) -> str:
        return "cpu"  # verl moves tensors to this; an integer index would name an accelerator

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg: str):
        return contextlib.nullcontext()

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> None:
        return None
