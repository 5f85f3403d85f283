"""Activation checkpointing of a Hugging Face model's decoder layers, switched on only where the learner wants it.

Hugging Face recomputes a layer in the backward only while that layer is in training mode. The learner keeps
the model in eval mode (no dropout: its log-probs must be those of the policy that sampled), so it sets the
training flag of the checkpointed layers alone, not of their children, and only around the passes that should
recompute (not the fast OPOB capture, which needs every activation anyway, nor the rollout engine).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from vcpo.config import ConfigError


def enable_activation_checkpointing(model: nn.Module) -> list[nn.Module]:
    """Turn on non-reentrant activation checkpointing; returns the modules it applies to.

    Raises ConfigError naming the key and the model class when the model does not support checkpointing."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"trainer.gradient_checkpointing: {type(model).__name__} does not support it")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return [m for m in model.modules() if m is not model and getattr(m, "gradient_checkpointing", False) is True]


@contextmanager
def checkpointing_active(modules: list[nn.Module]) -> Iterator[None]:
    """Inside: the checkpointed modules' own training flags are set (so they recompute); restored on exit."""
    previous = [m.training for m in modules]
    for m in modules:
        m.training = True
    try:
        yield
    finally:
        for m, was in zip(modules, previous, strict=True):
            m.training = was
