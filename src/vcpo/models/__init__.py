"""Policies: the embedded default model and loading any local Hugging Face causal LM.

Names are imported on first use, so that ``vcpo.models.files`` (the torch-free directory checks) stays light.
"""

from importlib import import_module
from typing import Any

_HOME = {"ModelLoadError": "files", "build_char_tokenizer": "default", "build_default_model": "default",
         "load_policy": "loading"}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'vcpo.models' has no attribute {name!r}")
    return getattr(import_module(f"vcpo.models.{_HOME[name]}"), name)
