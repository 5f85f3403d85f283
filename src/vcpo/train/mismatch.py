"""STUDY ONLY: a simulated sampler/learner mismatch, reward-independent log-normal noise on each sequence's
behaviour log-prob (``rollout.study_mismatch_std``, issue 24). Off (0) by default; no training recipe uses it.

In the VCPO paper's runs the sequence weights spread even without staleness (synchronous ESS ratio 0.6-0.75)
because inference and training kernels differ; in this project's runs the learner recomputes exactly what the
engine sampled, so W = 1 at k = 0 and all of W's spread under staleness is learning signal. This knob restores
a spread that carries no reward information, to test whether OPOB's cost depends on W carrying reward signal.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from vcpo.types import Batch


def mismatch_noise(group_ids_B: Tensor, std: float, seed: int) -> Tensor:
    """[B] float32 ``eps_i ~ N(0, std^2)``, a pure function of ``(seed, group id, row's rank within its group)``.

    Drawn from a generator of its own per group (never the run's sampling stream), so turning the knob on changes
    no sample, a group gets the same noise whenever it is trained on (replay), and rewards play no part."""
    if not std >= 0:
        raise ValueError(f"study mismatch std must be >= 0, got {std!r}")
    eps_B = torch.zeros(group_ids_B.shape[0], dtype=torch.float32)
    ids_B = group_ids_B.cpu()
    for gid in torch.unique(ids_B).tolist():
        rows = (ids_B == gid).nonzero(as_tuple=True)[0]
        generator = torch.Generator().manual_seed((seed * 1_000_003 + gid) % 2**63)
        eps_B[rows] = std * torch.randn(rows.numel(), generator=generator)
    return eps_B


def with_study_mismatch(batch: Batch, std: float, seed: int) -> Batch:
    """``batch`` with each row's behaviour log-prob raised by ``eps_i`` (``mismatch_noise``), spread evenly over its
    counted response tokens: ``log mu_i += eps_i``, so ``logW_i -= eps_i`` and ``W_i`` picks up the log-normal factor
    ``exp(-eps_i)``. With weights otherwise equal the ESS ratio of a large batch is about ``exp(-std^2)``
    (0.6-0.75, the paper's synchronous range, for std 0.54-0.71). ``std = 0`` returns ``batch`` itself."""
    if std == 0:
        return batch
    mask_BS = batch.response_mask_BS
    length_B = mask_BS.sum(1)
    eps_B = mismatch_noise(batch.group_ids_B, std, seed).to(batch.behavior_logprobs_BS.device)
    per_token_B = torch.where(length_B > 0, eps_B / length_B.clamp(min=1), torch.zeros_like(eps_B))
    blp_BS = batch.behavior_logprobs_BS + torch.where(mask_BS.bool(), per_token_B[:, None], 0.0).to(
        batch.behavior_logprobs_BS.dtype)
    return dataclasses.replace(batch, behavior_logprobs_BS=blp_BS)
