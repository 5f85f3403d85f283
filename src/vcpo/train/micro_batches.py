"""Micro-batches of one learner step: the plan under a token budget, the padding each one trims, and the
whole-batch statistics that every micro-batch is normalised by.

Why the update is exact (docs/trainer.md): every ``loss_agg`` mode is a sum over rows divided by a count of the
whole batch (``normaliser_count``), so a micro-batch's loss times ``count(part) / count(whole)`` is its share of
the full-batch loss, and the gradients of the shares sum to the full-batch gradient. That holds for objectives
whose per-row loss depends on its own row only (scope "row") and, when each group stays inside one micro-batch,
on its group (scope "group", and OPOB's baseline). Objectives with a batch-wide statistic (scope "batch") take
two passes: the objective sees the whole batch's detached log-probs once, and each micro-batch backpropagates
``sum coef * lp`` with ``coef = dL/dlp`` (exact, since L depends on the weights only through lp).

The seam for data-parallel learners: each rank would take whole groups, and the three whole-batch quantities a
step needs are made here, in one place each: the normaliser (``WholeBatch.count``: an all-reduce sum), the
sequence log-weights of the ESS (``gather_rows`` of ``logw``: an all-gather) and, for scope-"batch" objectives,
the log-probs and advantages they see (``gather_rows``: an all-gather). Gradients would be all-reduced before
clipping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vcpo.objectives import normaliser_count
from vcpo.types import Batch


def plan_micro_batches(
    lengths_B: Tensor, group_ids_B: Tensor, budget: int | None, keep_groups: bool
) -> list[Tensor]:
    """Row indices of each micro-batch, so that rows x longest row (after trimming padding) stays within
    ``budget`` tokens.

    None: one micro-batch of every row in order (the single pass). Otherwise the units (single rows, or whole
    groups with ``keep_groups``) are sorted longest first and packed in that order while they fit; a unit that
    alone exceeds the budget gets a micro-batch of its own (the budget cannot split a row, nor a kept group).
    """
    B = lengths_B.shape[0]
    if budget is None:
        return [torch.arange(B, device=lengths_B.device)]
    lengths = lengths_B.tolist()
    if keep_groups:
        by_group: dict[int, list[int]] = {}
        for b, g in enumerate(group_ids_B.tolist()):
            by_group.setdefault(g, []).append(b)
        units = list(by_group.values())
    else:
        units = [[b] for b in range(B)]
    unit_lengths = [max(lengths[b] for b in unit) for unit in units]
    plan: list[list[int]] = []
    longest = 0
    for i in sorted(range(len(units)), key=lambda i: -unit_lengths[i]):  # stable: ties keep batch order
        if plan and (len(plan[-1]) + len(units[i])) * longest <= budget:
            plan[-1].extend(units[i])
        else:
            plan.append(list(units[i]))
            longest = unit_lengths[i]
    return [torch.tensor(rows, dtype=torch.long, device=lengths_B.device) for rows in plan]


def trim_padding(batch: Batch) -> Batch:
    """The batch cut to its longest row (rows are right-padded): no forward pass over padding columns."""
    S = int(batch.attention_mask_BS.sum(1).max())
    if S == batch.input_ids_BS.shape[1]:
        return batch
    return Batch(**{name: value[:, :S] if value.dim() == 2 else value for name, value in batch.__dict__.items()})


@dataclass(frozen=True)
class WholeBatch:
    """What each micro-batch is normalised by: the whole batch's ``normaliser_count`` for the objective's
    ``loss_agg`` (with data-parallel ranks, the sum over ranks)."""

    count: float
    loss_agg: str

    @classmethod
    def of(cls, mask_BS: Tensor, loss_agg: str) -> WholeBatch:
        return cls(float(normaliser_count(mask_BS, loss_agg)), loss_agg)

    def loss_scale(self, mask_bS: Tensor) -> float:
        """``max(count(part), 1) / max(count(whole), 1)``: a part's loss times this is its share of the whole's."""
        return max(float(normaliser_count(mask_bS, self.loss_agg)), 1.0) / max(self.count, 1.0)


def gather_rows(parts: list[tuple[Tensor, Tensor]], B: int, S: int | None = None) -> Tensor:
    """The [B] (or [B, S], each part's columns left-aligned and zero-padded) tensor whose rows ``rows`` hold
    ``values`` for each ``(rows, values)`` part."""
    first = parts[0][1]
    shape = (B,) if S is None else (B, S)
    out = torch.zeros(shape, dtype=first.dtype, device=first.device)
    for rows, values in parts:
        if S is None:
            out[rows] = values
        else:
            out[rows, : values.shape[1]] = values
    return out
