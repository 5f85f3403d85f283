"""LoRA through peft: adapters injected into a Hugging Face causal LM, the tensors that sync engines to the learner,
and the adapter's checkpoint in peft's layout.

``apply_lora`` injects the adapters into the model in place and returns the same model object (its class, config,
generation config and every vcpo path that reads them are unchanged); peft's ``PeftModel`` wrapper is kept beside it
for saving, loading and merging. Each adapted linear layer computes ``y = W x + (alpha / r) B A x`` with ``W`` frozen,
``A`` [r, in] random and ``B`` [out, r] zero at the start (so the initial policy is the base model's).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from vcpo.errors import UserError

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_ATTR = "_vcpo_peft_model"


class LoraError(UserError):
    """A LoRA setting or adapter directory that cannot be used; one line naming the culprit."""


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise LoraError("model.lora.rank>0 needs peft, which is not installed: pip install 'vcpo[lora]'") from None
    return peft


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
               target_modules: list[str] | str = "all-linear") -> nn.Module:
    """Inject LoRA adapters into ``model`` (in place) and freeze every other parameter; returns ``model``.

    The adapters are peft's (float32 whatever the base's dtype: peft's ``autocast_adapter_dtype``); their config
    records the base model's directory (``base_model_name_or_path``). A ``target_modules`` that matches nothing is a
    ``LoraError`` naming ``model.lora.target_modules``."""
    peft = _peft()
    was_training = model.training
    base = getattr(model, "name_or_path", None) or None  # peft records it as base_model_name_or_path
    if base is not None and Path(base).is_dir():  # absolute: a checkpoint names its base wherever it is read from
        model.name_or_path = model.config._name_or_path = str(Path(base).resolve())
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                             task_type="CAUSAL_LM")
    try:
        with warnings.catch_warnings():  # peft asks transformers a deprecated question: not the user's concern
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            wrapper = peft.get_peft_model(model, config)
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        raise LoraError(f"model.lora.target_modules={target_modules!r}: {' '.join(str(exc).split())}") from None
    object.__setattr__(model, _PEFT_ATTR, wrapper)  # not a submodule: model.modules() stays the model's own
    return model.train(was_training)  # the new modules (adapter dropout) in the model's mode, as it was


def apply_lora_config(model: nn.Module, lora: Any) -> nn.Module:
    """``apply_lora`` with the settings of a ``model.lora`` config section (or its dict); off (rank 0): ``model``."""
    settings = lora if isinstance(lora, dict) else lora.model_dump()
    if int(settings["rank"]) == 0:
        return model
    return apply_lora(model, int(settings["rank"]), float(settings["alpha"]), float(settings["dropout"]),
                      settings["target_modules"])


def peft_model(model: nn.Module) -> Any:
    """The peft ``PeftModel`` around a model that ``apply_lora`` adapted; ``LoraError`` for any other model."""
    wrapper = getattr(model, _PEFT_ATTR, None)
    if wrapper is None:
        raise LoraError(f"{type(model).__name__} has no LoRA adapters")
    return wrapper


def is_lora(model: nn.Module) -> bool:
    return getattr(model, _PEFT_ATTR, None) is not None


def adapter_keys(model: nn.Module) -> list[str]:
    """The state-dict keys of the adapters' tensors (``...lora_A.default.weight``, ``...lora_B.default.weight``)."""
    return [name for name, p in model.named_parameters() if ".lora_" in name]


def sync_state_dict(model: nn.Module, keep_vars: bool = False) -> dict[str, Tensor]:
    """What a rollout engine needs to sample from ``model``'s current policy: the adapters' tensors for a LoRA model
    (the base weights never change), else the whole state dict. Keys are ``model.state_dict()``'s."""
    state = model.state_dict(keep_vars=keep_vars)
    if not is_lora(model):
        return state
    return {key: state[key] for key in adapter_keys(model)}


def peft_state_dict(adapters: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``sync_state_dict``'s adapter tensors under the names of peft's ``adapter_model.safetensors``
    (``X.lora_A.default.weight`` -> ``base_model.model.X.lora_A.weight``), which other servers (vLLM) load."""
    renamed = {}
    for key, value in adapters.items():
        if ".lora_A.default." not in key and ".lora_B.default." not in key:
            raise LoraError(f"{key!r} is not a LoRA adapter tensor of the default adapter")
        peft_key = key.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
        renamed["base_model.model." + peft_key] = value
    return renamed


def save_adapter(model: nn.Module, directory: str | Path) -> None:
    """Write the adapter in peft's layout: ``adapter_model.safetensors`` and ``adapter_config.json``."""
    wrapper = peft_model(model)
    wrapper.save_pretrained(str(directory), safe_serialization=True)
    (Path(directory) / "README.md").unlink(missing_ok=True)  # peft's empty model card


def load_adapter(model: nn.Module, directory: str | Path) -> None:
    """Copy ``directory``'s adapter (peft's layout) into ``model``'s adapters; ``LoraError`` unless it holds exactly
    the model's adapter tensors with their shapes (nothing is copied then)."""
    path = Path(directory) / ADAPTER_WEIGHTS
    try:
        saved = load_file(path)
    except Exception as exc:
        raise LoraError(f"adapter weights {path} cannot be read: {' '.join(str(exc).split())[:300]}") from None
    peft = _peft()
    wrapper = peft_model(model)
    expected = peft.get_peft_model_state_dict(wrapper)
    missing, unexpected = sorted(expected.keys() - saved.keys()), sorted(saved.keys() - expected.keys())
    wrong = [k for k in expected.keys() & saved.keys() if expected[k].shape != saved[k].shape]
    if missing or unexpected or wrong:
        raise LoraError(f"adapter {path} does not fit the model: missing {missing[:2]}, unexpected {unexpected[:2]}, "
                        f"other shape {wrong[:2]}")
    with torch.no_grad():
        peft.set_peft_model_state_dict(wrapper, saved)


def save_adapter_config(model: nn.Module, directory: str | Path) -> Path:
    """Write the adapters' ``adapter_config.json`` into ``directory`` (weights published to ``vcpo serve`` carry it,
    so the server builds the same adapters); returns its path."""
    peft_model(model).peft_config["default"].save_pretrained(str(directory))
    return Path(directory) / ADAPTER_CONFIG


def adapter_base(directory: str | Path) -> str | None:
    """The base model directory an adapter's ``adapter_config.json`` names (``base_model_name_or_path``)."""
    try:
        return json.loads((Path(directory) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError) as exc:
        raise LoraError(f"{Path(directory) / ADAPTER_CONFIG} cannot be read: {exc}") from None


def lora_settings(directory: str | Path) -> dict[str, Any]:
    """The ``model.lora`` settings an ``adapter_config.json`` holds (to rebuild the same adapters elsewhere)."""
    try:
        config = json.loads((Path(directory) / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise LoraError(f"{Path(directory) / ADAPTER_CONFIG} cannot be read: {exc}") from None
    targets = config["target_modules"]
    return {"rank": config["r"], "alpha": config["lora_alpha"], "dropout": config.get("lora_dropout", 0.0),
            "target_modules": sorted(targets) if isinstance(targets, list) else targets}
