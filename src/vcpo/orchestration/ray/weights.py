"""Versioned weight sync through the Ray object store: each policy version is put there once (by learner rank 0,
or by the driver when no learner group published it) and every rollout actor fetches that one object."""

from __future__ import annotations

from typing import Any

import ray
import torch

from vcpo.models.lora import sync_state_dict


def host_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights a rollout engine needs (a LoRA model's adapters only) as CPU tensors (what the object store holds,
    whatever device the model is on)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in sync_state_dict(model).items()}


class WeightBoard:
    """The driver's record of the newest published version and its object: ``post`` by the learner group, ``ref``
    by the rollout source (which puts the driver's weights once when nobody posted that version)."""

    def __init__(self) -> None:
        self.latest: tuple[int, Any] | None = None

    def post(self, version: int, ref: Any) -> None:
        self.latest = (version, ref)

    def ref(self, version: int, model: torch.nn.Module) -> Any:
        if self.latest is None or self.latest[0] != version:
            self.latest = (version, ray.put(host_state_dict(model)))
        return self.latest[1]
