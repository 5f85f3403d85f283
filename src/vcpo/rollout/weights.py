"""Weight publication for inference servers: the interface the orchestration calls, and its disk implementation
(an atomic safetensors directory per version, then each server's pause -> update -> resume).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from safetensors.torch import save_file
from torch import Tensor

PREFIX = "v"


class WeightPublisher(Protocol):
    """Makes policy ``version`` (``state_dict``) the weights every rollout server samples with; blocks until done."""

    def publish(self, state_dict: Mapping[str, Tensor], version: int) -> None: ...


def distinct_tensors(state_dict: Mapping[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
    """``state_dict``'s entries in order, an alias of an earlier entry (tied embeddings: the same memory, shape and
    strides) left out, as ``save_pretrained`` does; loaders fill the alias from the tensor it shares."""
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for key, value in state_dict.items():
        ident = (value.untyped_storage().data_ptr() + value.storage_offset() * value.element_size(),
                 tuple(value.shape), tuple(value.stride()))
        if ident not in seen:
            seen.add(ident)
            yield key, value


def _host_copies(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Host copies of every entry, an alias (tied embeddings) written under its own name as a copy of the tensor it
    shares: a server that reloads parameter by parameter (vLLM's ``reload_weights``) would otherwise keep a tied LM
    head's start-up values while the embeddings move on. safetensors refuses shared memory, hence the copies."""
    distinct = {key for key, _ in distinct_tensors(state_dict)}
    return {key: (value.detach().to("cpu").contiguous() if key in distinct else value.detach().to("cpu").clone())
            for key, value in state_dict.items()}


def write_weights_dir(root: str | Path, state_dict: Mapping[str, Tensor], version: int, keep_last: int = 2,
                      extra_files: Sequence[str | Path] = (), filename: str = "model.safetensors") -> Path:
    """Write ``root/v{version:08d}/{filename}`` (every key of ``state_dict``, tied ones included, plus
    ``extra_files``, e.g. config.json) atomically: into a temporary directory renamed into place, so a server never
    reads a half-written version. Keeps this version and the ``keep_last - 1`` before it; removes older ones and any
    above it (left by a run resumed from an earlier checkpoint). Returns the directory."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{version:08d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}-tmp-"))
    try:
        save_file(_host_copies(state_dict), str(tmp / filename), metadata={"format": "pt"})
        for extra in extra_files:
            shutil.copy2(extra, tmp / Path(extra).name)
        tmp.chmod(0o755)
        if final.exists():  # the same version again (a resumed run): the new bytes replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    others = sorted(int(p.name[1:]) for p in root.iterdir()
                    if p.is_dir() and p.name.startswith(PREFIX) and p.name[1:].isdigit() and p != final)
    # Versions above this one belong to an abandoned timeline (a run resumed from an earlier checkpoint).
    older = [v for v in others if v < version]
    stale = [v for v in others if v > version] + older[: max(len(older) - (max(keep_last, 1) - 1), 0)]
    for v in stale:
        shutil.rmtree(root / f"{PREFIX}{v:08d}", ignore_errors=True)
    return final
