"""Loading a policy (model and tokenizer) from any local Hugging Face causal-LM directory, offline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


class ModelLoadError(ValueError):
    """A model directory that cannot be used; its message is one line naming the path and the problem."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else exc.__class__.__name__


def load_policy(path: str | Path, dtype: str = "float32", device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a local directory, never touching the network; the model in ``dtype`` on ``device``.

    The tokenizer always has an EOS id and a pad id (pad falls back to EOS when the model has none).
    Raises :class:`ModelLoadError` for a missing path, a directory without ``config.json``, an unreadable
    config, an architecture transformers cannot load as a causal LM, or missing/broken weights.
    """
    p = Path(path)
    if dtype not in DTYPES:
        raise ModelLoadError(f"model dtype {dtype!r} for {str(p)!r} is not one of {', '.join(DTYPES)}")
    if not p.exists():
        raise ModelLoadError(f"model path {str(p)!r} does not exist")
    if not p.is_dir():
        raise ModelLoadError(f"model path {str(p)!r} is not a directory")
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"model path {str(p)!r} has no config.json (not a Hugging Face model directory)")
    try:
        config = AutoConfig.from_pretrained(p, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"model path {str(p)!r}: cannot read config.json ({_first_line(exc)})") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(p, config=config, dtype=DTYPES[dtype], local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"model path {str(p)!r}: cannot load a causal LM ({_first_line(exc)})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"model path {str(p)!r}: cannot load its tokenizer ({_first_line(exc)})") from None
    _ensure_eos_and_pad(tokenizer, model, p)
    model.to(device).eval()
    return model, tokenizer


def _ensure_eos_and_pad(tokenizer: Any, model: Any, path: Path) -> None:
    """Give the tokenizer an EOS (from the model's generation config if needed) and a pad token."""
    if tokenizer.eos_token_id is None:
        eos = getattr(model.generation_config, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if not isinstance(eos, int):
            raise ModelLoadError(f"model path {str(path)!r}: the tokenizer has no EOS token and the model names none")
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def declares_chat_template(path: str | Path) -> bool | None:
    """Whether the tokenizer saved in a model directory has a chat template, read from its files without loading
    anything (``chat_template.jinja``, or a ``chat_template`` entry in ``tokenizer_config.json``); None when the
    directory has no ``tokenizer_config.json`` to tell (then loading the tokenizer decides)."""
    p = Path(path)
    if (p / "chat_template.jinja").is_file():
        return True
    try:
        return bool(json.loads((p / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return None
