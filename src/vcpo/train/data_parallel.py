"""Data-parallel learner ranks in one torch.distributed group: each rank trains on whole groups of the batch, and
the whole-batch quantities of the micro-batch seam (vcpo.train.micro_batches) are all-reduced or all-gathered.

Why the update equals one learner's on the same batch (docs/ray.md): every ``loss_agg`` mode is a row-additive sum
over a whole-batch count, so rank r's loss times ``count(rank r) / count(all ranks)`` (the count all-reduced) is its
share of the global loss and the gradients, all-reduced (summed) before clipping, are the global gradient. OPOB's
baselines are per group and a group never straddles ranks; the ESS, the batch-scope objectives' (BAPO, M2PO) inputs
and the metrics see the global batch through an all-gather. Every rank then takes the same AdamW step, so every
rank holds the same weights and optimizer state (rank 0's is the one that is published and checkpointed).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch import Tensor

from vcpo.config import Config
from vcpo.train.learner import Learner, _Part, _rows_of, merge_part_metrics
from vcpo.train.micro_batches import WholeBatch, plan_micro_batches, trim_padding
from vcpo.types import Batch
from vcpo.variance import compute_advantages


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float) -> None:
    """Join the learners' group: gloo for CPU tensors and NCCL for CUDA ones when CUDA is present, so a collective
    blocked by a dead peer ends after ``timeout_s`` rather than hanging."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def rank_rows(group_ids_B: Tensor, rank: int, world_size: int) -> Tensor:
    """The rows of the groups that ``rank`` trains on: groups in order of first appearance, dealt round-robin, so
    each rank takes whole groups and every rank agrees without communicating."""
    order: dict[int, int] = {}
    for g in group_ids_B.tolist():
        order.setdefault(g, len(order))
    mine = [b for b, g in enumerate(group_ids_B.tolist()) if order[g] % world_size == rank]
    return torch.tensor(mine, dtype=torch.long, device=group_ids_B.device)


class DataParallelLearner(Learner):
    """A ``Learner`` that is one rank of ``world_size``: same interface, ``step(batch)`` takes the global batch."""

    def __init__(self, model: torch.nn.Module, config: Config) -> None:
        super().__init__(model, config)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def all_reduce(self, tensor: Tensor) -> Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def gather_rows(self, parts: list[tuple[Tensor, Tensor]], B: int, S: int | None = None) -> Tensor:
        """All-gather of rows: each rank fills its own rows of a zero tensor and the ranks' tensors are summed
        (rows are disjoint, so adding zeros leaves every value exact)."""
        whole = super().gather_rows(parts, B, S)
        if whole.dtype == torch.bool:
            return self.all_reduce(whole.to(torch.uint8)).bool()
        return self.all_reduce(whole)

    def backward(self, batch: Batch) -> dict[str, float]:
        """This rank's share of grad_theta of the objective on the global ``batch``, summed over the ranks."""
        self.model.eval()
        batch = batch.to(self.device)
        self.optimizer.zero_grad()
        ac = self.config.advantage
        mine = rank_rows(batch.group_ids_B, self.rank, self.world_size)
        if mine.numel() == 0:
            raise ValueError(f"learner rank {self.rank} got no group: a batch needs at least trainer.num_learners "
                             f"= {self.world_size} groups")
        local = batch.rows(mine)
        plan = [mine[rows] for rows in plan_micro_batches(local.attention_mask_BS.sum(1), local.group_ids_B,
                                                          self.config.trainer.micro_batch_tokens, keep_groups=True)]
        adv_B = None
        if ac.estimator != "opob":  # per group, so the global batch's are those of each rank's groups
            adv_B = compute_advantages(ac.estimator, batch.rewards_B, batch.group_ids_B,
                                       lengths=batch.response_mask_BS.sum(1))
        if self.scope == "batch":
            parts, out = self.two_pass(batch, plan, adv_B)
        else:
            count = torch.tensor(float(WholeBatch.of(local.response_mask_BS, self.loss_agg).count), dtype=torch.float64)
            whole = WholeBatch(float(self.all_reduce(count)), self.loss_agg)
            parts, out = self.train_parts(batch, plan, adv_B, whole), None
        self.all_reduce_grads()
        return self.metrics(batch, parts, out)

    def train_parts(self, batch: Batch, plan: list[Tensor], adv_B: Tensor | None, whole: WholeBatch) -> list[_Part]:
        """This rank's micro-batches (``plan``: rows of the global ``batch``), each backpropagated at its share of the
        ``whole`` batch's loss."""
        return [self.part(trim_padding(batch.rows(rows)), rows, _rows_of(adv_B, rows), True, whole) for rows in plan]

    @torch.no_grad()
    def all_reduce_grads(self) -> None:
        """Sum the ranks' gradients in one flat buffer (before clipping, so every rank clips the global norm)."""
        self.optimizer.accumulate()
        params = self.optimizer.updated
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        self.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def metrics(self, batch: Batch, parts: list[_Part], out) -> dict[str, float]:
        """The global batch's metrics on every rank: the parts' rows all-gathered into one whole-batch part."""
        B, S = batch.input_ids_BS.shape
        whole = _Part(torch.arange(B, device=batch.input_ids_BS.device), batch, *(
            None if getattr(parts[0], name) is None else self.gather_rows([(p.rows, getattr(p, name)) for p in parts],
                                                                          B, width)
            for name, width in (("lp_bS", S), ("entropy_bS", S), ("logw_b", None), ("adv_b", None))))
        if parts[0].needed_b is not None:
            whole.G_b = self.gather_rows([(p.rows, p.G_b) for p in parts], B)
            whole.needed_b = self.gather_rows([(p.rows, p.needed_b) for p in parts], B)
        ranks: list[dict[str, float] | None] = [None] * self.world_size
        dist.all_gather_object(ranks, merge_part_metrics([p.metrics for p in parts]))
        whole.metrics = merge_part_metrics([r for r in ranks if r is not None])
        return super().metrics(batch, [whole], out)
