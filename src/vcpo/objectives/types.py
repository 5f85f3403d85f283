"""The vocabulary of the objective library: what an objective takes and what it returns.

Shapes live in the docs: B sequences, T token positions. Every objective is a pure function
``fn(inputs: ObjectiveInputs, *, loss_agg=..., **hyperparameters) -> ObjectiveOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to [-20, 20] before ``exp`` in loss paths (ALGORITHMS.md, notation)."""


def _shape(t: Tensor) -> str:
    return "x".join(str(s) for s in t.shape) or "scalar"


@dataclass(frozen=True)
class ObjectiveInputs:
    """Per-token tensors of one batch, validated on construction.

    logprobs: [B, T] float, log pi_theta of the sampled tokens (carries the gradient).
    behavior_logprobs: [B, T] float, log mu of the same tokens from the rollout engine.
    advantages: [B] (one per sequence) or [B, T] float.
    mask: [B, T] bool / 0-1, response tokens that count.
    old_logprobs: optional [B, T], the proximal policy of decoupled PPO (None = bypass mode).
    rewards: optional [B] raw scalar rewards (TOPR, TB).
    group_ids: optional [B] int, the GRPO group of each sequence (TB).
    ref_logprobs: optional [B, T], the reference policy (TB).
    """

    logprobs: Tensor
    behavior_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    old_logprobs: Tensor | None = None
    rewards: Tensor | None = None
    group_ids: Tensor | None = None
    ref_logprobs: Tensor | None = None
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        lp = self.logprobs
        if not isinstance(lp, Tensor) or lp.dim() != 2 or not lp.is_floating_point():
            raise ValueError(
                f"logprobs must be a float tensor of shape [B, T], got "
                f"{type(lp).__name__} {getattr(lp, 'dtype', '')} {_shape(lp) if isinstance(lp, Tensor) else ''}"
            )
        B, T = lp.shape
        for name in ("behavior_logprobs", "mask", "old_logprobs", "ref_logprobs"):
            t = getattr(self, name)
            if t is None:
                continue
            if not isinstance(t, Tensor) or t.shape != lp.shape:
                raise ValueError(
                    f"{name} must have the shape of logprobs [{B}, {T}], got "
                    f"{_shape(t) if isinstance(t, Tensor) else type(t).__name__}"
                )
            if name != "mask" and not t.is_floating_point():
                raise ValueError(f"{name} must be a float tensor, got dtype {t.dtype}")
        adv = self.advantages
        if not isinstance(adv, Tensor) or adv.shape not in (torch.Size([B]), torch.Size([B, T])):
            raise ValueError(
                f"advantages must have shape [{B}] or [{B}, {T}] (logprobs is [{B}, {T}]), got "
                f"{_shape(adv) if isinstance(adv, Tensor) else type(adv).__name__}"
            )
        if not adv.is_floating_point():
            raise ValueError(f"advantages must be a float tensor, got dtype {adv.dtype}")
        for name in ("rewards", "group_ids"):
            t = getattr(self, name)
            if t is not None and (not isinstance(t, Tensor) or t.shape != torch.Size([B])):
                raise ValueError(
                    f"{name} must have shape [{B}] (one per sequence of logprobs [{B}, {T}]), got "
                    f"{_shape(t) if isinstance(t, Tensor) else type(t).__name__}"
                )
        if self.rewards is not None and not self.rewards.is_floating_point():
            raise ValueError(f"rewards must be a float tensor, got dtype {self.rewards.dtype}")
        if self.group_ids is not None and self.group_ids.is_floating_point():
            raise ValueError(f"group_ids must be an integer tensor, got dtype {self.group_ids.dtype}")

    # Derived views, computed once per inputs object. All are detached except where noted.
    @property
    def mask_f(self) -> Tensor:
        """[B, T] mask as the float dtype of logprobs."""
        if "mask_f" not in self._cache:
            self._cache["mask_f"] = self.mask.to(self.logprobs.dtype)
        return self._cache["mask_f"]

    @property
    def adv_BT(self) -> Tensor:
        """[B, T] advantages broadcast per token (detached)."""
        a = self.advantages.detach().to(self.logprobs.dtype)
        return a.unsqueeze(1).expand_as(self.logprobs) if a.dim() == 1 else a

    @property
    def proximal_logprobs(self) -> Tensor:
        """[B, T] log-probs that ratio-based objectives divide by: old_logprobs, else behavior."""
        ref = self.old_logprobs if self.old_logprobs is not None else self.behavior_logprobs
        return ref.detach()

    @property
    def behavior_log_ratio(self) -> Tensor:
        """[B, T] detached, unclamped d = lp - blp, zeroed outside the mask."""
        if "behavior_log_ratio" not in self._cache:
            d = self.logprobs.detach() - self.behavior_logprobs.detach()
            self._cache["behavior_log_ratio"] = torch.where(self.mask.bool(), d, torch.zeros_like(d))
        return self._cache["behavior_log_ratio"]

    @property
    def seq_log_weights(self) -> Tensor:
        """[B] detached, unclamped logW_i = sum_t m * (lp - blp) (a true product, no length norm)."""
        return self.behavior_log_ratio.sum(dim=1)

    @property
    def lengths(self) -> Tensor:
        """[B] L_i = number of counted tokens per sequence (float)."""
        return self.mask_f.sum(dim=1)


@dataclass
class ObjectiveOutput:
    """A scalar loss (``loss.backward()`` gives the policy gradient) and flat float diagnostics."""

    loss: Tensor
    metrics: dict[str, float] = field(default_factory=dict)
