"""Trajectory balance with a VarGrad partition estimate (TBA): an off-policy, sequence-level
squared-residual loss that needs no importance weights."""

from __future__ import annotations

import torch
from torch import Tensor

from vcpo.objectives.aggregation import aggregate
from vcpo.objectives.registry import register
from vcpo.objectives.types import ObjectiveInputs, ObjectiveOutput


def group_mean(values_B: Tensor, group_ids_B: Tensor, weight_B: Tensor) -> Tensor:
    """[B] the ``weight``-weighted mean of ``values`` over each sequence's group, broadcast back;
    0 for a group whose weights sum to 0."""
    _, inverse_B = torch.unique(group_ids_B, return_inverse=True)
    n_groups = int(inverse_B.max()) + 1 if inverse_B.numel() else 0
    sums_G = values_B.new_zeros(n_groups).index_add(0, inverse_B, values_B * weight_B)
    counts_G = values_B.new_zeros(n_groups).index_add(0, inverse_B, weight_B)
    return (sums_G / counts_G.clamp(min=1.0))[inverse_B]


@register("tb", scope="group")
def tb(
    inp: ObjectiveInputs,
    *,
    loss_agg: str = "seq-mean-token-mean",
    max_len: int | None = None,
    beta: float = 0.012,
) -> ObjectiveOutput:
    """``delta_i = logZ_g + sum_t m*lp - R_i/beta - sum_t m*reflp``; loss ``mean_i delta_i^2``.

    Trajectory balance (Malkin et al. 2022, arXiv 2201.13259) as used for LLMs by TBA (Bartoldson
    et al. 2025, arXiv 2503.18929): the target is ``pi* ∝ pi_ref * exp(R/beta)``, the optimum of
    the KL-regularised reward with KL coefficient beta. ``logZ_g`` is the VarGrad estimate, the
    mean over the prompt group g of ``R_j/beta + sum_t m*reflp_j - sum_t m*lp_j``, detached, so
    ``d loss / d lp[i,t] = 2 * delta_i * m[i,t] / B_eff`` (B_eff = sequences with a counted token).
    Off-policy by construction: no behavior log-probs enter the loss.

    Choices, where the papers leave one:
    - ``beta = 0.012``: the KL coefficient TBA's GSM8K code starts from (it anneals it to 0.004;
      annealing belongs to the trainer).
    - ``loss_agg``: delta_i^2 is broadcast to every counted token of sequence i, then aggregated
      like any per-token loss. The default ``seq-mean-token-mean`` is exactly mean_i delta_i^2;
      ``token-mean`` weighs sequences by length; the two sum modes scale delta_i^2 by L_i.
    - ``rewards`` None: the advantages stand in (their per-sequence mean over counted tokens when
      [B, T]). ``group_ids`` None: the whole batch is one group (one sequence per group would make
      every delta zero). ``ref_logprobs`` None: the reference term is dropped (pi_ref uniform in
      log space, up to a constant that logZ absorbs).
    - Rows with no counted token are no trajectories: they are left out of logZ and of the loss.

    Metrics: ``tb/logz_mean`` (mean of logZ over counted sequences), ``tb/delta_sq_mean``.
    """
    m_BT = inp.mask.bool()
    mask_f = inp.mask_f
    dtype = inp.logprobs.dtype
    nonempty_B = (inp.lengths > 0).to(dtype)
    seq_lp_B = torch.where(m_BT, inp.logprobs, torch.zeros_like(inp.logprobs)).sum(dim=1)
    if inp.ref_logprobs is None:
        seq_ref_B = torch.zeros_like(nonempty_B)
    else:
        ref = inp.ref_logprobs.detach().to(dtype)
        seq_ref_B = torch.where(m_BT, ref, torch.zeros_like(ref)).sum(dim=1)
    if inp.rewards is not None:
        rewards_B = inp.rewards.detach().to(dtype)
    else:
        rewards_B = (inp.adv_BT * mask_f).sum(dim=1) / inp.lengths.clamp(min=1.0)
    groups_B = inp.group_ids if inp.group_ids is not None else torch.zeros_like(nonempty_B, dtype=torch.long)
    target_B = rewards_B / beta + seq_ref_B
    # Masked-out rows are zeroed first so that their garbage cannot reach a group's mean.
    vargrad_B = torch.where(nonempty_B > 0, target_B - seq_lp_B.detach(), torch.zeros_like(target_B))
    logz_B = group_mean(vargrad_B, groups_B, nonempty_B)
    delta_B = torch.where(nonempty_B > 0, logz_B + seq_lp_B - target_B, torch.zeros_like(target_B))
    loss_BT = (delta_B**2).unsqueeze(1).expand_as(inp.logprobs)
    loss = aggregate(loss_BT, inp.mask, loss_agg, max_len)
    n = float(nonempty_B.sum())
    metrics = {
        "tb/logz_mean": float((logz_B * nonempty_B).sum()) / n if n else 0.0,
        "tb/delta_sq_mean": float((delta_B.detach() ** 2).sum()) / n if n else 0.0,
    }
    return ObjectiveOutput(loss, metrics)
