"""``vcpo export``: a training checkpoint as a plain Hugging Face model directory (no optimizer, RNG or trainer state).

A full fine-tuning checkpoint is already one: its model and tokenizer files are copied. A sharded one
(``trainer.sharding: fsdp``) holds the model's config and its weights as the ranks' shards: the model is built from
the config, each weight read whole (torch.distributed.checkpoint, in one process, however many ranks wrote it) and
saved in the config's dtype. A LoRA checkpoint holds the
adapter alone (peft's layout) and names its base (``adapter_config.json``'s ``base_model_name_or_path``):

- ``merge=True``: the base with ``W + (alpha / r) B A`` folded into each adapted weight (peft's ``merge_and_unload``),
  a model any loader reads (transformers, vLLM) with no LoRA code;
- ``merge=False``: the base model's files and the adapter's (``adapter_model.safetensors``, ``adapter_config.json``)
  side by side; ``AutoModelForCausalLM.from_pretrained(DIR)`` with peft installed loads both (the adapter attached),
  as does ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DIR), DIR)``. A loader without LoRA
  support would read the base alone: give it the merged export.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from vcpo.errors import UserError
from vcpo.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_base, lora_settings

TRAINING_STATE = ("optimizer.pt", "rng.pt", "trainer_state.json")


class ExportError(UserError):
    """A checkpoint that cannot be exported, or an output directory that must not be written; one line."""


def export_checkpoint(checkpoint: str | Path, out: str | Path, merge: bool = False,
                      base: str | Path | None = None) -> Path:
    """Write ``checkpoint`` (a ``step_N`` directory) to ``out`` as a Hugging Face model directory; returns ``out``.

    ``base``: the base model directory of a LoRA checkpoint, when the one it names has moved. ``out`` must not exist
    or be empty; it is written into a temporary directory renamed into place, so a failed export leaves nothing."""
    ckpt, out = Path(checkpoint), Path(out)
    if not ckpt.is_dir():
        raise ExportError(f"checkpoint {str(ckpt)!r} is not a directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {str(out)!r} exists and is not an empty directory")
    lora = (ckpt / ADAPTER_WEIGHTS).is_file()
    if not lora and not (ckpt / "config.json").is_file():
        raise ExportError(f"checkpoint {str(ckpt)!r} holds neither a model (config.json) nor a LoRA adapter "
                          f"({ADAPTER_WEIGHTS})")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-tmp-"))
    try:
        if not lora:
            from vcpo.train.sharding import SHARDED_STATE

            if (ckpt / SHARDED_STATE).is_dir():
                _export_sharded(ckpt, tmp)
            for path in ckpt.iterdir():
                if path.is_file() and path.name not in TRAINING_STATE:
                    shutil.copy2(path, tmp / path.name)
        else:
            _export_lora(ckpt, tmp, merge, _base_dir(ckpt, base))
        tmp.chmod(0o755)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _export_sharded(ckpt: Path, out: Path) -> None:
    """The weights of a sharded checkpoint as safetensors in ``out``, in the dtype its config names."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from vcpo.train.sharding import SHARDED_STATE, load_sharded_whole

    config = AutoConfig.from_pretrained(ckpt, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    try:
        load_sharded_whole(model, None, ckpt / SHARDED_STATE)
    except (RuntimeError, ValueError, KeyError) as e:
        raise ExportError(f"checkpoint {str(ckpt)!r}: its sharded weights do not fit its config.json "
                          f"({' '.join(str(e).split())[:300]})") from None
    dtype = getattr(config, "dtype", None) or torch.float32
    model.to(dtype).save_pretrained(out)


def _base_dir(ckpt: Path, base: str | Path | None) -> Path:
    named = base if base is not None else adapter_base(ckpt)
    if named is None or not Path(named).is_dir():
        raise ExportError(f"the base model of {str(ckpt)!r} ({named}) is not a directory here: name it with --base")
    return Path(named)


def _export_lora(ckpt: Path, out: Path, merge: bool, base: Path) -> None:
    """The base (loaded in float32 or its checkpoint's dtype, as saved) with the checkpoint's adapter, merged or
    beside it, and the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    from vcpo.models.loading import load_policy
    from vcpo.models.lora import apply_lora_config, load_adapter, peft_model

    dtype = json.loads((base / "config.json").read_text()).get("dtype") or "float32"
    model, _ = load_policy(base, dtype if dtype in ("float32", "bfloat16") else "float32", "cpu")
    if not merge:
        model.save_pretrained(out)
    model = apply_lora_config(model, lora_settings(ckpt))
    load_adapter(model, ckpt)
    wrapper = peft_model(model)
    if merge:
        wrapper.merge_and_unload().save_pretrained(out)
    else:
        wrapper.save_pretrained(str(out))
        (out / "README.md").unlink(missing_ok=True)
        config = json.loads((out / ADAPTER_CONFIG).read_text())
        config["base_model_name_or_path"] = None  # the base is this directory's own model
        (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    AutoTokenizer.from_pretrained(ckpt, local_files_only=True).save_pretrained(out)
