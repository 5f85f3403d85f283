"""Loading a policy (model and tokenizer) from any local Hugging Face causal-LM directory, offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from vcpo.models.files import ModelLoadError, check_model_dir, one_line

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def load_policy(path: str | Path, dtype: str = "float32", device: str | torch.device = "cpu") -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a local directory, never touching the network; the model in ``dtype`` on ``device``.

    The tokenizer always has an EOS id and a pad id (pad falls back to EOS when the model has none).
    Raises :class:`ModelLoadError` for a missing path, a directory without ``config.json`` or tokenizer
    files, an unreadable config, an architecture transformers cannot load as a causal LM, or missing/broken
    weights; the message holds the library's whole reason on one line.
    """
    if dtype not in DTYPES:
        raise ModelLoadError(f"model dtype {dtype!r} for {str(path)!r} is not one of {', '.join(DTYPES)}")
    p = check_model_dir(path, tokenizer=False)  # its tokenizer files are checked once the weights loaded
    try:
        config = AutoConfig.from_pretrained(p, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"model path {str(p)!r}: cannot read config.json ({one_line(exc)})") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(p, config=config, dtype=DTYPES[dtype], local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"model path {str(p)!r}: cannot load a causal LM ({one_line(exc)})") from None
    check_model_dir(p)
    try:
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"model path {str(p)!r}: cannot load its tokenizer ({one_line(exc)})") from None
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
