"""Loss aggregation: the four ways of reducing a per-token loss to a scalar (ALGORITHMS.md §1)."""

from __future__ import annotations

import torch
from torch import Tensor

from vcpo.objective_specs import LOSS_AGG_MODES


def aggregate(loss_BT: Tensor, mask_BT: Tensor, loss_agg: str, max_len: int | None = None) -> Tensor:
    """Reduce a per-token loss ``l`` with mask ``m`` ([B, T]) to a scalar.

    - ``token-mean``: sum(l*m) / sum(m) over the whole batch.
    - ``seq-mean-token-mean``: mean_i( sum_t l*m / L_i ) (original GRPO).
    - ``seq-mean-token-sum``: mean_i( sum_t l*m ).
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): sum(l*m) / (B * max_len), max_len a fixed constant.

    Choice: the two ``seq-mean`` modes average over the sequences with at least one counted
    token, so an all-masked row contributes nothing and does not dilute the others; the Dr. GRPO
    mode divides by the full batch size B, as its constant normaliser is meant to.
    Masking objectives multiply ``loss_BT`` by their keep-mask and pass the *pre-mask* ``mask_BT``,
    which keeps the denominators at the pre-mask token count as ALGORITHMS.md §1 requires.
    """
    if loss_agg not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg {loss_agg!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")
    m = mask_BT.to(loss_BT.dtype)
    lm = loss_BT * m
    # Zero masked positions explicitly so inf/nan outside the mask never leaks into the sum.
    lm = lm.masked_fill(m == 0, 0.0)
    if loss_agg == "token-mean":
        return lm.sum() / m.sum().clamp(min=1.0)
    if loss_agg == "seq-mean-token-sum-norm":
        if max_len is None or int(max_len) <= 0:
            raise ValueError(f"loss_agg 'seq-mean-token-sum-norm' needs max_len > 0, got max_len={max_len!r}")
        return lm.sum() / (loss_BT.shape[0] * int(max_len))
    lengths_B = m.sum(dim=1)
    nonempty_B = (lengths_B > 0).to(loss_BT.dtype)
    seq_B = lm.sum(dim=1)
    if loss_agg == "seq-mean-token-mean":
        seq_B = seq_B / lengths_B.clamp(min=1.0)
    return (seq_B * nonempty_B).sum() / nonempty_B.sum().clamp(min=1.0)


def normaliser_count(mask_BT: Tensor, loss_agg: str) -> Tensor:
    """The count that ``aggregate`` divides by, before its clamp at 1 (and, for Dr. GRPO, times ``max_len``):
    counted tokens (``token-mean``), sequences with a counted token (the ``seq-mean`` modes), or rows B
    (``seq-mean-token-sum-norm``); a float64 scalar.

    Every mode is a row-additive sum divided by this count, so the loss of a part of the batch times
    ``max(count(part), 1) / max(count(whole), 1)`` sums over the parts to the whole batch's loss: that is how
    micro-batches reproduce the full-batch update (vcpo.train.micro_batches)."""
    if loss_agg not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg {loss_agg!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")
    m = mask_BT.to(torch.float64)
    if loss_agg == "token-mean":
        return m.sum()
    if loss_agg == "seq-mean-token-sum-norm":
        return torch.tensor(float(mask_BT.shape[0]), dtype=torch.float64, device=mask_BT.device)
    return (m.sum(dim=1) > 0).sum().to(torch.float64)
