"""Policies: the embedded default model and loading any local Hugging Face causal LM."""

from vcpo.models.default import build_char_tokenizer, build_default_model
from vcpo.models.loading import ModelLoadError, load_policy

__all__ = ["ModelLoadError", "build_char_tokenizer", "build_default_model", "load_policy"]
