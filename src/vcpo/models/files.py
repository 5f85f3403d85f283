"""What a usable model directory holds, checked from its file names alone (torch-free, so before any heavy import)."""

from __future__ import annotations

import json
from pathlib import Path

from vcpo.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
"""The files transformers builds a tokenizer from; a directory with none of them has no tokenizer."""


class ModelLoadError(UserError, ValueError):
    """A model directory that cannot be used; its message is one line naming the path and the problem."""


def check_model_dir(path: str | Path, tokenizer: bool = True) -> Path:
    """``path`` if it looks like a Hugging Face model directory (with tokenizer files, unless ``tokenizer``
    is False), else ``ModelLoadError`` naming what is missing."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model path {str(p)!r} does not exist")
    if not p.is_dir():
        raise ModelLoadError(f"model path {str(p)!r} is not a directory")
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"model path {str(p)!r} has no config.json (not a Hugging Face model directory)")
    if tokenizer and not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"model path {str(p)!r} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} is there")
    return p


def one_line(error: BaseException) -> str:
    """A library's error message, every line of it, on one line."""
    return " ".join(str(error).split()) or type(error).__name__


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


def no_chat_template(where: str | Path) -> str:
    """The message for chat prompts with the tokenizer of ``where``, which has no chat template."""
    return (f"task.prompt_format=chat but the tokenizer of {where} has no chat template (set task.prompt_format=raw, "
            "or add a chat_template to its tokenizer_config.json)")
