"""Small helpers the objective modules share: clamped ratios and the standard signature."""

from __future__ import annotations

import torch
from torch import Tensor

from vcpo.objectives.types import LOG_RATIO_CLAMP, ObjectiveInputs


def clamped_exp(log_x: Tensor) -> Tensor:
    """``exp(clamp(log_x, -20, 20))``: the only way a loss path exponentiates a log-ratio."""
    return torch.exp(log_x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def proximal_log_ratio(inp: ObjectiveInputs) -> Tensor:
    """[B, T] ``lp - sg(proximal)``: against old_logprobs when given, else behavior (bypass mode).

    Carries the gradient of ``lp``; masked positions are zeroed so that garbage there stays out.
    """
    d = inp.logprobs - inp.proximal_logprobs
    return torch.where(inp.mask.bool(), d, torch.zeros_like(d))
