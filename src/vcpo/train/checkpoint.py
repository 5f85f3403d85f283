"""Atomic training checkpoints: Hugging Face weights (safetensors) + tokenizer, optimizer, trainer state, RNG; for a
LoRA model the adapter alone in peft's layout (``adapter_model.safetensors``, ``adapter_config.json`` naming the base).
A sharded learner group (``trainer.sharding: fsdp``) writes its weights and optimizer state as its ranks' shards
(``sharded/``, torch.distributed.checkpoint) beside the model's config; any number of ranks, or one unsharded process,
reads them back (vcpo.train.sharding).

Layout: ``run_dir/checkpoints/step_000010/`` (loadable with ``from_pretrained``) and a ``latest`` file naming it
(``vcpo.train.run_dir`` finds them). Non-finite weights are never written; a failed write leaves the previous
checkpoint the latest and is one error naming the path.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from vcpo.errors import DiskError, UserError
from vcpo.metrics import fsync_dir
from vcpo.models.lora import ADAPTER_WEIGHTS, LoraError, adapter_base, is_lora, load_adapter, save_adapter
from vcpo.train.precision import LearnerOptimizer
from vcpo.train.run_dir import LATEST_FILE, complete_checkpoints, latest_checkpoint
from vcpo.train.sharding import SHARDED_STATE, load_sharded_whole

__all__ = ["CheckpointError", "discard_after", "latest_checkpoint", "load_checkpoint", "save_checkpoint", "set_aside"]


class CheckpointError(UserError):
    """A missing, incomplete or corrupt checkpoint; the message is one line naming the path."""


@runtime_checkable
class ShardedState(Protocol):
    """The optimizer of a sharded learner group, as checkpoints see it: its ranks write and read their own shards of
    the trained weights and the optimizer state in a directory."""

    def save_sharded(self, path: Path) -> None: ...

    def load_sharded(self, path: Path) -> None: ...


def _step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _one_line(error: BaseException) -> str:
    """A library error squeezed onto one line (torch's state-dict errors span many)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{type(error).__name__}: {text[:300]}"


@contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Silence transformers' 'Writing model shards' bar so a checkpoint does not break the trainer's display."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _rng_state(generators: dict[str, torch.Generator] | None) -> dict[str, Any]:
    """Every RNG state as tensors and plain Python values, so that ``torch.load(weights_only=True)`` reads it."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss),
        "torch": torch.get_rng_state(),
        "generators": {name: g.get_state() for name, g in (generators or {}).items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict[str, Any], generators: dict[str, torch.Generator] | None) -> None:
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    random.setstate(state["python"])
    np.random.set_state((np_name, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, generator in (generators or {}).items():
        generator.set_state(state["generators"][name])


def _fsync_tree(directory: Path) -> None:
    """Flush every file under ``directory`` to disk before it is renamed into place."""
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(directory)


def _write_latest(ckpt_root: Path, name: str) -> None:
    tmp = ckpt_root / f"{LATEST_FILE}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt_root / LATEST_FILE)
    fsync_dir(ckpt_root)


def check_finite(model: torch.nn.Module, step: int) -> None:
    """``CheckpointError`` naming the first parameter or buffer that holds a NaN or an infinity."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"refusing to checkpoint step {step}: {name} holds non-finite values")


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    generators: dict[str, torch.Generator] | None = None,
    keep: int | None = 2,
) -> Path:
    """Write ``run_dir/checkpoints/step_{step:06d}/`` atomically and return it.

    Contents: the model (``save_pretrained``, safetensors; a LoRA model's adapter alone, in peft's layout; a sharded
    group's config, its weights in ``sharded/`` with the optimizer state) and tokenizer, ``optimizer.pt``,
    ``trainer_state.json`` (``trainer_state`` plus ``step``) and ``rng.pt`` (Python,
    NumPy, torch CPU/CUDA states and each named generator's state). Everything is written into a
    ``.tmp-<pid>`` directory that is renamed into place only when complete; then ``latest`` is
    replaced atomically, and all but the ``keep`` newest checkpoints (every one kept when ``keep`` is None) and
    leftovers of interrupted saves (one writer per run directory) are deleted. Weights holding a NaN or an infinity
    raise ``CheckpointError`` before anything is written; a failed write raises ``DiskError`` naming the
    path, removes its partial copy and leaves the previous checkpoint the latest.
    """
    if keep is not None and keep < 1:
        raise CheckpointError(f"keep must be >= 1 checkpoints, got {keep}")
    check_finite(model, step)
    try:
        state_json = json.dumps({**trainer_state, "step": step}, indent=2)
    except TypeError as e:
        raise CheckpointError(f"trainer_state for step {step} is not JSON-serialisable: {e}") from None
    ckpt_root = Path(run_dir) / "checkpoints"
    final = ckpt_root / _step_dir_name(step)
    tmp = ckpt_root / f"{final.name}.tmp-{os.getpid()}"
    try:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        with _quiet_progress_bars():
            if is_lora(model):  # the base is fixed: adapter_config.json names its directory
                save_adapter(model, tmp)
            elif isinstance(optimizer, ShardedState):  # the weights are the ranks' shards: the model's files only
                model.config.save_pretrained(tmp)
                model.generation_config.save_pretrained(tmp)
            else:
                model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        if isinstance(optimizer, ShardedState):
            optimizer.save_sharded(tmp / SHARDED_STATE)
        else:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(_rng_state(generators), tmp / "rng.pt")
        # trainer_state.json last: its presence is what marks a step directory complete.
        (tmp / "trainer_state.json").write_text(state_json + "\n", encoding="utf-8")
        _fsync_tree(tmp)
        _move_into_place(tmp, final)
        fsync_dir(ckpt_root)
        _write_latest(ckpt_root, final.name)
    except (OSError, RuntimeError, SafetensorError) as e:  # how a full or read-only disk surfaces in each library
        error = DiskError(tmp, e)  # before the cleanup frees the space it reports on
        shutil.rmtree(tmp, ignore_errors=True)
        raise error from None
    older = complete_checkpoints(run_dir)[:-keep] if keep is not None else []
    for _, path in older:
        if path != final:
            shutil.rmtree(path, ignore_errors=True)
    for path in ckpt_root.glob("step_*.tmp-*"):
        shutil.rmtree(path, ignore_errors=True)
    return final


def set_aside(run_dir: Path, step: int) -> Path | None:
    """Rename step ``step``'s checkpoint to ``step_N.suspect`` (kept for inspection, never resumed from) and point
    ``latest`` at the newest remaining complete one; returns that one (None: none is left, ``latest`` removed)."""
    ckpt_root = Path(run_dir) / "checkpoints"
    target = ckpt_root / _step_dir_name(step)
    try:
        if target.is_dir():
            suspect = target.with_name(f"{target.name}.suspect")
            shutil.rmtree(suspect, ignore_errors=True)  # an older copy set aside before a resume: this one is newer
            os.replace(target, suspect)
        remaining = complete_checkpoints(run_dir)
        if remaining:
            _write_latest(ckpt_root, remaining[-1][1].name)
        else:
            (ckpt_root / LATEST_FILE).unlink(missing_ok=True)
        fsync_dir(ckpt_root)
    except OSError as e:
        raise DiskError(target, e) from None
    return remaining[-1][1] if remaining else None


def discard_after(run_dir: Path, step: int) -> None:
    """Delete every checkpoint newer than ``step`` and point ``latest`` at step ``step``'s (a health rollback to it)."""
    ckpt_root = Path(run_dir) / "checkpoints"
    try:
        for later, path in complete_checkpoints(run_dir):
            if later > step:
                shutil.rmtree(path)
        _write_latest(ckpt_root, _step_dir_name(step))
        fsync_dir(ckpt_root)
    except OSError as e:
        raise DiskError(ckpt_root, e) from None


def _move_into_place(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; re-saving a step (after a resume) moves the old copy aside, never mixing two."""
    if not final.exists():
        os.replace(tmp, final)
        return
    old = final.with_name(f"{final.name}.old-{os.getpid()}")
    os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old)


def _weight_files(ckpt_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: one file, or the shards listed by the index."""
    single = ckpt_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = ckpt_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [ckpt_dir / shard for shard in shards]
    raise CheckpointError(f"checkpoint {ckpt_dir} is incomplete: no model.safetensors")


def _load_adapter(ckpt_dir: Path, model: torch.nn.Module) -> None:
    """A LoRA checkpoint into a LoRA model whose base is the one the adapter was trained on."""
    if not is_lora(model):
        raise CheckpointError(f"checkpoint {ckpt_dir} holds a LoRA adapter but the model has none (model.lora.rank=0)")
    saved_base, base = adapter_base(ckpt_dir), getattr(model.config, "_name_or_path", None)
    if saved_base and base and str(Path(saved_base).resolve()) != str(Path(base).resolve()):
        raise CheckpointError(f"checkpoint {ckpt_dir}'s adapter was trained on the base {saved_base}, not {base}")
    try:
        load_adapter(model, ckpt_dir)
    except LoraError as e:
        raise CheckpointError(str(e)) from None


def _load_weights(ckpt_dir: Path, model: torch.nn.Module) -> None:
    """Copy the saved tensors into ``model``; keys omitted because they are tied to a saved one are fine."""
    if (ckpt_dir / ADAPTER_WEIGHTS).is_file():
        _load_adapter(ckpt_dir, model)
        return
    if is_lora(model):
        raise CheckpointError(f"checkpoint {ckpt_dir} holds full weights, no LoRA adapter (model.lora.rank>0)")
    saved: dict[str, torch.Tensor] = {}
    for path in _weight_files(ckpt_dir):
        try:
            saved.update(load_file(path))
        except Exception as e:
            raise CheckpointError(f"checkpoint weights {path} are corrupt: {_one_line(e)}") from None
    try:
        result = model.load_state_dict(saved, strict=False)
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {ckpt_dir} does not fit the model: {_one_line(e)}") from None
    # save_pretrained drops tied copies (e.g. lm_head.weight = embed_tokens.weight); the loaded twin fills them.
    params = model.state_dict()
    loaded_ptrs = {params[k].data_ptr() for k in params if k in saved}
    untied_missing = [k for k in result.missing_keys if params[k].data_ptr() not in loaded_ptrs]
    if untied_missing or result.unexpected_keys:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} does not fit the model: missing {untied_missing[:3]}, "
            f"unexpected {result.unexpected_keys[:3]}"
        )


def _loads_whole(optimizer: Any) -> bool:
    """Whether one process reads a sharded checkpoint whole into this optimizer (a single unsharded learner's, or
    none: weights only)."""
    return optimizer is None or isinstance(optimizer, LearnerOptimizer)


def _load_sharded(ckpt_dir: Path, model: torch.nn.Module, optimizer: Any) -> None:
    """A sharded checkpoint into a sharded group (its ranks read their shards and publish into ``model``), or whole
    into one process's model and optimizer."""
    if (ckpt_dir / ADAPTER_WEIGHTS).is_file():
        _load_adapter(ckpt_dir, model)  # checks the base it was trained on
    try:
        if isinstance(optimizer, ShardedState):
            optimizer.load_sharded(ckpt_dir / SHARDED_STATE)
        else:
            load_sharded_whole(model, optimizer, ckpt_dir / SHARDED_STATE)
    except (RuntimeError, ValueError, KeyError) as e:  # DCP's "missing key" / shape errors
        raise CheckpointError(f"checkpoint {ckpt_dir}/{SHARDED_STATE} does not fit the model: {_one_line(e)}") from None


def load_checkpoint(
    ckpt_dir: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    generators: dict[str, torch.Generator] | None = None,
) -> dict[str, Any]:
    """Restore weights into ``model``, the optimizer state, every RNG and the named generators; return trainer_state.

    ``optimizer=None`` loads weights (and RNG) only, e.g. for evaluation.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint not found: {ckpt_dir}")
    sharded = (ckpt_dir / SHARDED_STATE).is_dir()
    if sharded != isinstance(optimizer, ShardedState) and not (sharded and _loads_whole(optimizer)):
        raise CheckpointError(f"checkpoint {ckpt_dir} was written {'with' if sharded else 'without'} "
                              f"trainer.sharding=fsdp: resume it with trainer.sharding={'fsdp' if sharded else 'none'}"
                              f"{' or a single learner' if sharded else ''}")
    for name in ("trainer_state.json", "rng.pt") + (("optimizer.pt",) if optimizer is not None and not sharded else ()):
        if not (ckpt_dir / name).is_file():
            raise CheckpointError(f"checkpoint {ckpt_dir} is incomplete: no {name}")
    try:
        trainer_state = json.loads((ckpt_dir / "trainer_state.json").read_text(encoding="utf-8"))
        # On CPU first: load_state_dict moves optimizer state to each parameter's device, wherever it was saved.
        rng = torch.load(ckpt_dir / "rng.pt", map_location="cpu", weights_only=True)
        optim_state = (
            torch.load(ckpt_dir / "optimizer.pt", map_location="cpu", weights_only=True)
            if optimizer is not None and not sharded
            else None
        )
    except Exception as e:
        raise CheckpointError(f"checkpoint {ckpt_dir} is corrupt: {_one_line(e)}") from None
    unknown = sorted((generators or {}).keys() - rng["generators"].keys())
    if unknown:  # checked before anything is modified, so a failed load leaves the run untouched
        raise CheckpointError(f"checkpoint {ckpt_dir} has no state for generator(s) {', '.join(unknown)}")
    if sharded:
        _load_sharded(ckpt_dir, model, optimizer)
    else:
        _load_weights(ckpt_dir, model)
    if optimizer is not None and not sharded:
        try:
            optimizer.load_state_dict(optim_state)
        except (ValueError, KeyError) as e:
            raise CheckpointError(
                f"checkpoint {ckpt_dir}/optimizer.pt does not fit the optimizer: {_one_line(e)}"
            ) from None
    _restore_rng(rng, generators)
    return trainer_state
