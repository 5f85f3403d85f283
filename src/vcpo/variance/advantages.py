"""Group advantage estimators (GRPO, Dr. GRPO, RLOO, OPO, OPOB) and the name-based dispatch over them."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from vcpo.variance.baselines import (
    check_vectors,
    float_dtype,
    group_index,
    group_mean,
    group_sum,
    opob_advantages,
)


def _prepare(rewards: Tensor, group_ids: Tensor, **others: Tensor | None) -> tuple[Tensor, Tensor, int]:
    """Validated float rewards_B (detached), each sequence's dense group index and the group count."""
    check_vectors(rewards=rewards, group_ids=group_ids, **others)
    rewards_B = rewards.detach().to(float_dtype(rewards))
    inverse_B, n_groups = group_index(group_ids)
    return rewards_B, inverse_B, n_groups


def grpo_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """[B] GRPO advantages ``A_i = (R_i - mean_g R) / (std_g R + eps)`` (Shao et al. 2024, arXiv 2402.03300).

    ``std_g`` is the SAMPLE std (Bessel's n - 1, as ``torch.std`` computes it and as the common GRPO
    implementations use); a group of one sequence has std 0 and so advantage 0. Note that VCPO's
    ``opob_advantages`` divides by the population std instead.
    """
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"grpo_advantages: eps must be a finite number > 0, got {eps!r}")
    rewards_B, inverse_B, n_groups = _prepare(rewards, group_ids)
    centered_B = rewards_B - group_mean(rewards_B, inverse_B, n_groups)[inverse_B]
    sum_sq_G = group_sum(centered_B.square(), inverse_B, n_groups)
    count_G = group_sum(torch.ones_like(rewards_B), inverse_B, n_groups)
    std_G = (sum_sq_G / (count_G - 1).clamp(min=1)).sqrt()
    return centered_B / (std_G[inverse_B] + eps)


def dr_grpo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """[B] Dr. GRPO advantages ``A_i = R_i - mean_g R``: GRPO without the std division, which biases
    towards easy and hard prompts (Liu et al. 2025, arXiv 2503.20783)."""
    rewards_B, inverse_B, n_groups = _prepare(rewards, group_ids)
    return rewards_B - group_mean(rewards_B, inverse_B, n_groups)[inverse_B]


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """[B] RLOO advantages ``A_i = R_i - mean_{j in g, j != i} R_j`` (Ahmadian et al. 2024, arXiv 2402.14740).

    Equivalently ``n/(n-1) (R_i - mean_g R)`` for a group of size n; a group of one sequence has no
    other member to compare with and gets advantage 0.
    """
    rewards_B, inverse_B, n_groups = _prepare(rewards, group_ids)
    sum_B = group_sum(rewards_B, inverse_B, n_groups)[inverse_B]
    count_B = group_sum(torch.ones_like(rewards_B), inverse_B, n_groups)[inverse_B]
    others_mean_B = (sum_B - rewards_B) / (count_B - 1).clamp(min=1)
    return torch.where(count_B > 1, rewards_B - others_mean_B, torch.zeros_like(rewards_B))


def opo_advantages(rewards: Tensor, group_ids: Tensor, lengths: Tensor) -> Tensor:
    """[B] OPO advantages ``A_i = R_i - b_g`` with the length-weighted baseline
    ``b_g = sum_{j in g} L_j R_j / sum_{j in g} L_j`` (Hao et al. 2025, arXiv 2505.23585).

    ``lengths`` are the response lengths ``L_j >= 0`` (token counts). A group whose lengths sum to 0
    falls back to the plain group mean.
    """
    rewards_B, inverse_B, n_groups = _prepare(rewards, group_ids, lengths=lengths)
    lengths_B = lengths.detach().to(rewards_B.dtype)
    if bool((lengths_B < 0).any()):
        raise ValueError("opo_advantages: lengths must be >= 0")
    total_length_G = group_sum(lengths_B, inverse_B, n_groups)
    weighted_G = group_sum(lengths_B * rewards_B, inverse_B, n_groups)
    has_length_G = total_length_G > 0
    baseline_G = torch.where(
        has_length_G,
        weighted_G / torch.where(has_length_G, total_length_G, torch.ones_like(total_length_G)),
        group_mean(rewards_B, inverse_B, n_groups),
    )
    return rewards_B - baseline_G[inverse_B]


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "opo": opo_advantages,
    "opob": opob_advantages,
}

# Inputs beyond (rewards, group_ids) that an estimator cannot run without.
_REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "opo": ("lengths",),
    "opob": ("logw", "grad_sq_norms"),
}


def compute_advantages(
    name: str, rewards: Tensor, group_ids: Tensor, *, lengths: Tensor | None = None,
    logw: Tensor | None = None, grad_sq_norms: Tensor | None = None, **options: float | str,
) -> Tensor:
    """[B] advantages from the estimator registered as ``name`` in ``ADVANTAGE_ESTIMATORS``.

    ``"opo"`` needs ``lengths``; ``"opob"`` needs ``logw`` and ``grad_sq_norms``; the others use only
    ``rewards`` and ``group_ids`` (inputs an estimator does not use are ignored, so a trainer can pass
    everything it has). ``options`` go to the estimator as keywords (``eps`` for GRPO and
    OPOB; ``weighting``, ``cap`` and ``variant`` for OPOB). Unknown name, or a missing input: ValueError naming it.
    """
    if name not in ADVANTAGE_ESTIMATORS:
        valid = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {valid}")
    available = {"lengths": lengths, "logw": logw, "grad_sq_norms": grad_sq_norms}
    inputs = {}
    for arg in _REQUIRED_INPUTS.get(name, ()):
        if available[arg] is None:
            raise ValueError(f"advantage estimator {name!r} needs the argument {arg!r}")
        inputs[arg] = available[arg]
    return ADVANTAGE_ESTIMATORS[name](rewards=rewards, group_ids=group_ids, **inputs, **options)
