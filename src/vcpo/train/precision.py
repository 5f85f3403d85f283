"""The learner's optimizer and its mixed-precision policy: AdamW over float32 master weights for half-precision
models, with gradients accumulated in float32 across micro-batches.

Policy (docs/trainer.md): the model holds its weights in ``model.dtype`` and runs forward and backward in it (on a
GPU, bfloat16 tensor cores; the rollout engine shares those weights). For a bfloat16 (or float16) parameter the
optimizer keeps a float32 master copy: each backward's gradient is added to the master's float32 gradient and
cleared from the model (so micro-batches sum in float32), clipping and AdamW (float32 moments) act on the masters,
and the updated masters are rounded back into the model. A float32 or float64 model is optimised in place, exactly
as a plain ``torch.optim.AdamW`` would.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

HALF = (torch.bfloat16, torch.float16)


class LearnerOptimizer:
    """AdamW over the trainable parameters, through float32 masters where a parameter is half precision.

    ``param_groups`` are AdamW's (the learner sets ``lr`` per step); ``state_dict()`` is AdamW's when no parameter
    needs a master (the format of a plain AdamW checkpoint), else ``{"adamw": ..., "master_weights": [...]}``.
    """

    def __init__(self, params: list[nn.Parameter], lr: float, betas: tuple[float, float], weight_decay: float) -> None:
        self.params = params
        self.masters: list[Tensor | None] = [
            p.detach().float().clone().requires_grad_() if p.dtype in HALF else None for p in params
        ]
        self.updated = [p if m is None else m for p, m in zip(params, self.masters, strict=True)]
        self.adamw = torch.optim.AdamW(self.updated, lr=lr, betas=betas, weight_decay=weight_decay)

    @property
    def has_masters(self) -> bool:
        return any(m is not None for m in self.masters)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.adamw.param_groups

    def zero_grad(self) -> None:
        for p in (*self.params, *self.updated):
            p.grad = None

    @torch.no_grad()
    def accumulate(self) -> None:
        """Move the model's half-precision gradients into the masters' float32 gradients (after each backward)."""
        for p, m in zip(self.params, self.masters, strict=True):
            if m is None or p.grad is None:
                continue
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.add_(p.grad)
            p.grad = None

    def clip_grad_norm(self, max_norm: float) -> float:
        """The total gradient norm before clipping, after clipping the gradients to ``max_norm`` in place."""
        self.accumulate()
        return float(torch.nn.utils.clip_grad_norm_(self.updated, max_norm))

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step; half-precision parameters receive their updated masters, rounded."""
        self.adamw.step()
        for p, m in zip(self.params, self.masters, strict=True):
            if m is not None:
                p.copy_(m)

    def state_dict(self) -> dict[str, Any]:
        if not self.has_masters:
            return self.adamw.state_dict()
        return {"adamw": self.adamw.state_dict(), "master_weights": [m for m in self.masters if m is not None]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore AdamW's state and the masters; raises ValueError when the state does not fit."""
        if not self.has_masters:
            if "adamw" in state:
                raise ValueError("the state holds float32 master weights but the model is not half precision")
            self.adamw.load_state_dict(state)
            return
        if "master_weights" not in state:
            raise ValueError("the state has no float32 master weights (saved from a float32 model?)")
        masters = [m for m in self.masters if m is not None]
        saved = state["master_weights"]
        if len(saved) != len(masters) or any(s.shape != m.shape for s, m in zip(saved, masters, strict=False)):
            raise ValueError("the saved master weights do not fit the model's parameters")
        self.adamw.load_state_dict(state["adamw"])
        for m, s in zip(masters, saved, strict=True):
            m.copy_(s)
        for p, m in zip(self.params, self.masters, strict=True):
            if m is not None:
                p.copy_(m)
