"""OPOB, VCPO's closed-form off-policy optimal baseline (arXiv 2602.17616, §8.3), its variants (the paper's
plug-in, leave-one-out, gradient-only), and the per-group reductions over arbitrary integer group ids that every
group advantage estimator shares."""

from __future__ import annotations

import math

import torch
from torch import Tensor

OPOB_WEIGHTINGS = ("paper", "authors_code")
OPOB_VARIANTS = ("plugin", "leave_one_out", "grad_only")


def check_vectors(**vectors: Tensor | None) -> int:
    """The length B shared by the given 1-D tensors (None ones are skipped).

    Raises ValueError naming every tensor and its shape when they are not non-empty, 1-D and of one length.
    """
    shapes = {name: tuple(v.shape) for name, v in vectors.items() if v is not None}
    lengths = {s[0] if len(s) == 1 else -1 for s in shapes.values()}
    if len(lengths) != 1 or min(lengths) <= 0:
        described = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"expected non-empty 1-D tensors of one length B, got {described}")
    return lengths.pop()


def float_dtype(*tensors: Tensor) -> torch.dtype:
    """The promoted floating dtype of the tensors (the default dtype when none is floating)."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype if dtype.is_floating_point else torch.get_default_dtype()


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """``(inverse_B, n_groups)``: each sequence's dense group index in [0, n_groups), for any integer ids."""
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    unique_G, inverse_B = torch.unique(group_ids, return_inverse=True)
    return inverse_B, unique_G.numel()


def group_sum(x_B: Tensor, inverse_B: Tensor, n_groups: int) -> Tensor:
    """[G] sum of ``x_B`` over each group."""
    return torch.zeros(n_groups, dtype=x_B.dtype, device=x_B.device).index_add_(0, inverse_B, x_B)


def group_mean(x_B: Tensor, inverse_B: Tensor, n_groups: int) -> Tensor:
    """[G] mean of ``x_B`` over each group."""
    return group_sum(x_B, inverse_B, n_groups) / group_sum(torch.ones_like(x_B), inverse_B, n_groups)


def group_population_std(x_B: Tensor, inverse_B: Tensor, n_groups: int) -> Tensor:
    """[G] population std ``sqrt(mean_g (x - mean_g)^2)`` (divides by n, not n - 1)."""
    centered_B = x_B - group_mean(x_B, inverse_B, n_groups)[inverse_B]
    return group_mean(centered_B.square(), inverse_B, n_groups).sqrt()


def _check_opob_options(weighting: str, cap: float, variant: str) -> None:
    if weighting not in OPOB_WEIGHTINGS:
        raise ValueError(f"unknown OPOB weighting {weighting!r}; valid weightings: {', '.join(OPOB_WEIGHTINGS)}")
    if variant not in OPOB_VARIANTS:
        raise ValueError(f"unknown OPOB variant {variant!r}; valid variants: {', '.join(OPOB_VARIANTS)}")
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"OPOB cap must be a finite number > 0, got {cap!r}")


def _opob_log_weights(logw_B: Tensor, grad_sq_norms_B: Tensor, weighting: str, cap: float, variant: str) -> Tensor:
    """[B] log of each row's OPOB weight: ``log(W^2 G)``, times ``min(W, cap)^2`` for ``authors_code``, without
    the ``W^2`` for ``grad_only``. ``G = 0`` gives -inf, a weight of exactly 0."""
    if bool((grad_sq_norms_B < 0).any()):
        raise ValueError("grad_sq_norms must be >= 0 (they are squared gradient norms)")
    log_weight_B = torch.log(grad_sq_norms_B) if variant == "grad_only" else 2 * logw_B + torch.log(grad_sq_norms_B)
    if weighting == "authors_code":
        log_weight_B = log_weight_B + 2 * logw_B.clamp(max=math.log(cap))
    return log_weight_B


def _opob_group_baseline(rewards_B: Tensor, log_weight_B: Tensor, inverse_B: Tensor, n_groups: int) -> Tensor:
    """[G] the plug-in baseline of each group; inputs are already detached, validated and of one float dtype."""
    shift_G = torch.full((n_groups,), -math.inf, dtype=log_weight_B.dtype, device=log_weight_B.device)
    shift_G = shift_G.scatter_reduce(0, inverse_B, log_weight_B, reduce="amax")
    shift_B = shift_G[inverse_B]
    # A group whose largest log-weight is not finite (all G = 0, or an infinite or nan weight) has no
    # usable weighting: zero weights send it to the mean-reward fallback below.
    weight_B = torch.where(torch.isfinite(shift_B), torch.exp(log_weight_B - shift_B), torch.zeros_like(shift_B))
    denominator_G = group_sum(weight_B, inverse_B, n_groups)
    numerator_G = group_sum(weight_B * rewards_B, inverse_B, n_groups)
    usable_G = torch.isfinite(denominator_G) & (denominator_G > 0)
    safe_denominator_G = torch.where(usable_G, denominator_G, torch.ones_like(denominator_G))
    return torch.where(usable_G, numerator_G / safe_denominator_G, group_mean(rewards_B, inverse_B, n_groups))


def _leave_one_out_baseline(rewards_B: Tensor, log_weight_B: Tensor, inverse_B: Tensor, n_groups: int) -> Tensor:
    """[B] each row's baseline over the OTHER rows of its group, ``sum_{j != i} w_j R_j / sum_{j != i} w_j``.

    The group is laid out as a padded [G, N] table and each row gets its own shift, the largest log-weight of the
    others, so the others' relative weights survive however much larger row i's own weight is (subtracting it
    from the group's sum would cancel them to 0). Where the others' weights vanish or are not finite: their mean
    reward; a group of one row: its own reward (advantage 0, as RLOO)."""
    B = rewards_B.shape[0]
    order_B = torch.argsort(inverse_B, stable=True)
    count_G = torch.bincount(inverse_B, minlength=n_groups)
    start_G = torch.cumsum(count_G, 0) - count_G
    sorted_group_B = inverse_B[order_B]
    slot_B = torch.empty_like(inverse_B)
    slot_B[order_B] = torch.arange(B, device=inverse_B.device) - start_G[sorted_group_B]
    N = int(count_G.max())
    log_weight_GN = log_weight_B.new_full((n_groups, N), -math.inf).index_put((inverse_B, slot_B), log_weight_B)
    rewards_GN = rewards_B.new_zeros((n_groups, N)).index_put((inverse_B, slot_B), rewards_B)
    # [B, N]: row i's view of its group with itself (and the padding) at -inf.
    others_BN = log_weight_GN[inverse_B].index_put(
        (torch.arange(B, device=inverse_B.device), slot_B), log_weight_B.new_full((B,), -math.inf)
    )
    rewards_BN = rewards_GN[inverse_B]
    shift_B = others_BN.amax(dim=1)
    finite_B = torch.isfinite(shift_B)
    weight_BN = torch.where(finite_B[:, None], torch.exp(others_BN - torch.where(finite_B, shift_B, 0.0)[:, None]),
                            torch.zeros_like(others_BN))
    denominator_B = weight_BN.sum(1)
    usable_B = torch.isfinite(denominator_B) & (denominator_B > 0)
    weighted_B = (weight_BN * rewards_BN).sum(1) / torch.where(usable_B, denominator_B, torch.ones_like(denominator_B))
    others_B = (count_G - 1)[inverse_B]
    others_mean_B = (group_sum(rewards_B, inverse_B, n_groups)[inverse_B] - rewards_B) / others_B.clamp(min=1)
    fallback_B = torch.where(others_B > 0, others_mean_B, rewards_B)
    return torch.where(usable_B, weighted_B, fallback_B)


def _opob_prepare(
    rewards: Tensor, logw: Tensor, grad_sq_norms: Tensor, group_ids: Tensor, weighting: str, cap: float, variant: str,
) -> tuple[Tensor, Tensor, int, Tensor]:
    """Validated float rewards_B, inverse_B, n_groups and each row's OPOB baseline b_B."""
    check_vectors(rewards=rewards, logw=logw, grad_sq_norms=grad_sq_norms, group_ids=group_ids)
    _check_opob_options(weighting, cap, variant)
    dtype = float_dtype(rewards, logw, grad_sq_norms)
    rewards_B, logw_B, grad_sq_norms_B = (t.detach().to(dtype) for t in (rewards, logw, grad_sq_norms))
    inverse_B, n_groups = group_index(group_ids)
    log_weight_B = _opob_log_weights(logw_B, grad_sq_norms_B, weighting, cap, variant)
    if variant == "leave_one_out":
        baseline_B = _leave_one_out_baseline(rewards_B, log_weight_B, inverse_B, n_groups)
    else:
        baseline_B = _opob_group_baseline(rewards_B, log_weight_B, inverse_B, n_groups)[inverse_B]
    return rewards_B, inverse_B, n_groups, baseline_B


def opob_rows_needing_grad_norms(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """[B] bool: the rows whose OPOB advantage depends on their ``G_i``, those of groups whose rewards differ.

    In a group of equal rewards ``r`` every weighting gives ``b_g = r`` and ``Ahat_i = 0``, and so does the
    mean-reward fallback that ``G_i = 0`` selects: such rows need no gradient norm (in training, about half
    the groups of a step; ``reward/zero_var_group_frac``)."""
    check_vectors(rewards=rewards, group_ids=group_ids)
    inverse_B, n_groups = group_index(group_ids)
    r_B = rewards.detach().to(float_dtype(rewards))
    high_G = torch.full((n_groups,), -math.inf, dtype=r_B.dtype, device=r_B.device)
    low_G = torch.full((n_groups,), math.inf, dtype=r_B.dtype, device=r_B.device)
    high_G = high_G.scatter_reduce(0, inverse_B, r_B, reduce="amax")
    low_G = low_G.scatter_reduce(0, inverse_B, r_B, reduce="amin")
    return (high_G > low_G)[inverse_B]


def opob_baseline(
    rewards: Tensor, logw: Tensor, grad_sq_norms: Tensor, group_ids: Tensor, *,
    weighting: str = "paper", cap: float = 8.0, variant: str = "plugin",
) -> Tensor:
    """[B] OPOB baseline of each sequence (VCPO, arXiv 2602.17616, §8.3; the variants are ours).

    ``weighting="paper"`` (default), the paper's formula, minimising ``E[W^2 (R - b)^2 ||grad log pi||^2]``:
        ``b_g = sum_{i in g} W_i^2 G_i R_i / sum_{i in g} W_i^2 G_i``
    ``weighting="authors_code"`` reproduces the authors' released code, which measures ``G_i`` on a
    gradient that already carries the truncated weight ``min(W_i, cap)``; given the plain ``G_i`` this is
        ``b_g = sum W_i^2 min(W_i, cap)^2 G_i R_i / sum W_i^2 min(W_i, cap)^2 G_i``
    (about ``W^4`` for ``W < cap``). ``cap`` is used only by ``"authors_code"``.

    ``variant`` (each combines with either weighting; ``w_j`` is the weighting's weight):
        ``"plugin"`` (default, the paper): ``b_g`` above; row i sits in its own baseline with share
        ``p_i = w_i / sum_j w_j``, so ``R_i - b_g = (1 - p_i)(R_i - b_{-i})``.
        ``"leave_one_out"``: ``b_{-i} = sum_{j in g, j != i} w_j R_j / sum_{j in g, j != i} w_j``; where the
        other rows' weights vanish (or are not finite), their mean reward; a group of one row gets ``R_i``.
        ``"grad_only"``: the plug-in baseline without ``W^2``: ``w_j = G_j`` (``min(W_j, cap)^2 G_j`` with
        ``"authors_code"``, whose G carries the truncated weight).

    ``W_i = exp(logw_i)`` exactly as given: the caller decides clipped or not. ``G_i >= 0`` is the
    squared norm of the trajectory's score gradient (see ``trajectory_grad_sq_norms``); ``G_i = 0``
    is allowed. Computed in log space, ``w_i = exp(log(W_i^2 G_i) - max_j log(W_j^2 G_j))`` with the max
    over the rows summed (the others of row i for ``leave_one_out``), so log-weights of +-1000 are fine. A
    group whose denominator is zero or not finite falls back to its mean reward. ``group_ids`` are arbitrary
    integers. Everything is detached: the baseline is a constant.
    """
    return _opob_prepare(rewards, logw, grad_sq_norms, group_ids, weighting, cap, variant)[3]


def opob_advantages(
    rewards: Tensor, logw: Tensor, grad_sq_norms: Tensor, group_ids: Tensor, eps: float = 1e-8, *,
    weighting: str = "paper", cap: float = 8.0, variant: str = "plugin",
) -> Tensor:
    """[B] VCPO advantages ``Ahat_i = (R_i - b_i) / sigma_g`` with an OPOB baseline (arXiv 2602.17616, §8.3).

    ``b_i`` is ``opob_baseline``'s (``b_g`` for ``"plugin"`` and ``"grad_only"``, ``b_{-i}`` for
    ``"leave_one_out"``, which with equal weights is RLOO's ``n/(n-1)`` times the plug-in advantage).
    ``sigma_g`` is the population std of the group's rewards (row i included); when ``sigma_g <= eps``
    (default 1e-8) the advantage is ``R_i - b_i`` unscaled. ``weighting``, ``cap`` and ``variant`` are those of
    ``opob_baseline``. This replaces GRPO's mean-centering; the result is detached.
    """
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"opob_advantages: eps must be a finite number >= 0, got {eps!r}")
    rewards_B, inverse_B, n_groups, baseline_B = _opob_prepare(
        rewards, logw, grad_sq_norms, group_ids, weighting, cap, variant
    )
    sigma_B = group_population_std(rewards_B, inverse_B, n_groups)[inverse_B]
    centered_B = rewards_B - baseline_B
    scaled_B = sigma_B > eps
    return torch.where(scaled_B, centered_B / torch.where(scaled_B, sigma_B, torch.ones_like(sigma_B)), centered_B)
