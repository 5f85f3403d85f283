"""``trainer.sharding: fsdp`` in one place: how a learner rank holds a model bigger than one device. FSDP2 shards each
decoder layer, then the root; this module builds such a rank's model (on the meta device, rank 0's weights broadcast
into every rank's shards), its optimizer (AdamW on the float32 shards), keeps the ranks' passes in step, gathers the
weights a layer at a time for publication, and reads and writes the checkpoint state (torch.distributed.checkpoint).

Why the update equals one process's on the same batch (docs/scaling.md): the learner is vcpo.train.data_parallel's,
whose ranks each backpropagate their share of the global loss; the gradient sum that class makes after the backward,
FSDP2 makes inside it (a reduce-scatter per layer, summed, not averaged), so each rank ends with its shard of the
global gradient. Precision: the shards are float32 (they are the master weights: no other copy), each layer is
gathered in ``model.dtype`` for its forward and backward, and gradients are reduced in float32.

A sharded forward or backward gathers every layer from every rank, so all ranks must run the same passes in the same
order: a rank with fewer micro-batches than another runs idle ones (a row whose loss is multiplied by 0), and the
choice between the fast OPOB capture's gradient and a second backward is made by all ranks together. The capture's
hooks see each layer whole (gathered) and this rank's rows: per-row norms need no collective.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial

from vcpo.config import Config, ConfigError
from vcpo.models.loading import DTYPES, load_policy
from vcpo.models.lora import apply_lora_config
from vcpo.objectives import ObjectiveOutput
from vcpo.train.data_parallel import DataParallelLearner
from vcpo.train.learner import _Part, _rows_of
from vcpo.train.micro_batches import WholeBatch, trim_padding
from vcpo.train.precision import LearnerOptimizer
from vcpo.types import Batch
from vcpo.variance.ghost_layers import weighted_grads
from vcpo.variance.ghost_norms import PerRowGradCapture

SHARDED_STATE = "sharded"
"""The directory of a checkpoint that holds its torch.distributed.checkpoint files (weights and optimizer state)."""

_TRAINABLE = StateDictOptions(ignore_frozen_params=True)
"""The checkpointed weights: the trained ones (a LoRA run's adapters; its base is the model it names)."""


def master_dtype(config: Config) -> torch.dtype:
    """The shards' dtype: float32 master weights for a float32 or bfloat16 model, float64 for a float64 one."""
    return torch.float64 if config.model.dtype == "float64" else torch.float32


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face model: the modules of the classes it names in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(f"trainer.sharding=fsdp: {type(model).__name__} names no decoder layer class "
                          "(_no_split_modules) to shard by")
    return layers


def shard_model(model: nn.Module, compute_dtype: torch.dtype) -> nn.Module:
    """Shard ``model`` (master-precision weights) in place over the default process group and return it:
    ``fully_shard`` on each decoder layer, then on the root (the embeddings, final norm and LM head), gathered in
    ``compute_dtype`` and reduced in at least float32, gradients summed over the ranks.

    The root's unit is whole through each forward and backward: for Qwen2.5-7B's untied embeddings and head, 1.1B
    parameters (2 GiB in bfloat16). Units of their own would halve that, but the fast OPOB norms recognise a module by
    its exact class, and FSDP2 gives a sharded module a class of its own (``FSDPEmbedding``)."""
    reduce_dtype = torch.promote_types(compute_dtype, torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)  # each rank's loss is its share of the global one: sum, not mean
            unit.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied one)
    return model


def build_sharded_model(model_path: str, config: Config, device: torch.device,
                        initial: dict[str, Tensor] | None = None) -> nn.Module:
    """This rank's sharded policy (with ``model.lora``'s adapters) on ``device``: every rank builds the architecture
    on the meta device and shards it; rank 0 alone loads the weights, on the CPU, and they are broadcast into each
    rank's shards a tensor at a time (``set_model_state_dict(broadcast_from_rank0=True)``), so no accelerator ever
    holds the whole model. ``initial`` (rank 0's only): tensors of the state dict to start from instead, e.g. the
    driver's LoRA adapters or its half-precision weights (an unsharded learner's masters start as those too)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    master = master_dtype(config)
    full: dict[str, Tensor] = {}
    buffers: dict[str, Tensor] = {}
    if dist.get_rank() == 0:
        loaded = apply_lora_config(load_policy(model_path, str(master).removeprefix("torch."), "cpu")[0],
                                   config.model.lora)
        full, buffers = loaded.state_dict(), dict(loaded.named_buffers())
        for key, value in (initial or {}).items():
            full[key] = value.detach().to(device="cpu", dtype=full[key].dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path, local_files_only=True),
                                                 dtype=master).eval()
    model = apply_lora_config(model, config.model.lora)
    shard_model(model, DTYPES[config.model.dtype])
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in model.named_buffers():  # the rotary tables are not in the state dict: rank 0's
            if buffers:
                buffer.copy_(buffers[name])
            dist.broadcast(buffer, src=0)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


class ShardedOptimizer(LearnerOptimizer):
    """AdamW on this rank's float32 shards, which are the master weights (no copies); the norm is the global one."""

    def clip_grad_norm(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.updated, max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


class ShardedLearner(DataParallelLearner):
    """A data-parallel rank whose model is sharded (``shard_model``): the same ``step`` on the global batch."""

    optimizer_class = ShardedOptimizer

    def reduce(self, value: int, op: dist.ReduceOp) -> int:
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=op)
        return int(tensor)

    def agreed(self, flag: bool) -> bool:
        return bool(self.reduce(int(flag), dist.ReduceOp.MIN))

    def idle_count(self, plan: list[Tensor]) -> int:
        """Passes this rank must add to match the rank with the most micro-batches."""
        return self.reduce(len(plan), dist.ReduceOp.MAX) - len(plan)

    @torch.no_grad()
    def add_captured_grad(self, capture: PerRowGradCapture, coef_B: Tensor) -> None:
        """This rank's rows' ``sum_b coef_b grad score_b`` (whole weights), summed over the ranks into each rank's
        shard: a reduce-scatter, as FSDP2's own backward makes."""
        for param, grad in weighted_grads(capture.terms, coef_B.detach()):
            shard = DTensor.from_local(grad, param.device_mesh, [Partial()]).redistribute(param.device_mesh,
                                                                                          param.placements)
            param.grad = shard if param.grad is None else param.grad + shard

    def all_reduce_grads(self) -> None:
        """Nothing left to sum: FSDP2 reduce-scattered each backward's gradients into the shards."""

    def idle_pass(self, spare: Batch, backward: bool) -> None:
        """The collectives of one micro-batch's ``part`` on a row of this rank's, contributing nothing."""
        lp_BS, _, capture, _ = self.forward(spare, grad=backward)
        if not backward:
            return
        if capture is not None and self.agreed(True):
            self.add_captured_grad(capture, torch.zeros(spare.size, dtype=torch.float32, device=self.device))
        else:
            (self.logprobs(spare) if capture is not None else lp_BS).sum().mul(0.0).backward()

    def train_parts(self, batch: Batch, plan: list[Tensor], adv_B: Tensor | None, whole: WholeBatch) -> list[_Part]:
        idle, spare = self.idle_count(plan), trim_padding(batch.rows(plan[0][:1]))
        parts = super().train_parts(batch, plan, adv_B, whole)
        for _ in range(idle):
            self.idle_pass(spare, backward=True)
        return parts

    def two_pass(self, batch: Batch, plan: list[Tensor], adv_B: Tensor | None) -> tuple[list[_Part], ObjectiveOutput]:
        """``Learner.two_pass`` with idle passes, so that every rank runs as many forwards, then as many backwards."""
        idle, spare = self.idle_count(plan), trim_padding(batch.rows(plan[0][:1]))
        parts = [self.part(trim_padding(batch.rows(rows)), rows, _rows_of(adv_B, rows), False) for rows in plan]
        for _ in range(idle):
            self.idle_pass(spare, backward=False)
        out = self.coupled_backward(batch, parts)
        for _ in range(idle):
            self.logprobs(spare).sum().mul(0.0).backward()
        return parts, out


def gathered_layers(model: nn.Module) -> Iterator[dict[str, Tensor]]:
    """The trained weights whole (a collective: every rank iterates), one decoder layer at a time in the model's order,
    then the root's (embeddings, final norm, LM head); keys are ``model.named_parameters()``'s. Each rank holds one
    layer gathered at a time: the caller copies it out before asking for the next."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    unit_of = {id(p): i for i, unit in enumerate(units) for p in unit.parameters()}
    groups: list[list[tuple[str, Tensor]]] = [[] for _ in range(len(units) + 1)]
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups[unit_of.get(id(param), len(units))].append((name, param))
    for group in groups:
        yield {name: param.full_tensor() for name, param in group}


def save_sharded(model: nn.Module, optimizer: LearnerOptimizer, path: Path) -> None:
    """Every rank writes its shards of the trained weights and AdamW's state into ``path`` (a collective)."""
    dcp.save({"model": get_model_state_dict(model, options=_TRAINABLE),
              "optimizer": get_optimizer_state_dict(model, optimizer.adamw, options=_TRAINABLE)},
             checkpoint_id=str(path))


def load_sharded(model: nn.Module, optimizer: LearnerOptimizer, path: Path) -> None:
    """Every rank reads its shards from a sharded checkpoint written by any number of ranks (a collective)."""
    state = {"model": get_model_state_dict(model, options=_TRAINABLE),
             "optimizer": get_optimizer_state_dict(model, optimizer.adamw, options=_TRAINABLE)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"], options=_TRAINABLE)
    set_optimizer_state_dict(model, optimizer.adamw, state["optimizer"], options=_TRAINABLE)


def trained_weights(model: nn.Module) -> dict[str, Tensor]:
    """The trained parameters of an unsharded model by their checkpoint names (a tied weight once, as
    ``named_parameters`` names it)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def load_sharded_whole(model: nn.Module, optimizer: LearnerOptimizer | None, path: Path) -> None:
    """A sharded checkpoint (any number of ranks wrote it) into one process's unsharded model and, if given, its
    optimizer: each tensor is read whole, into the float32 masters of a half-precision model."""
    weights = trained_weights(model)
    state: dict = {"model": {name: p.detach() for name, p in weights.items()}}
    if optimizer is not None:
        into = dict(zip((id(p) for p in optimizer.params), optimizer.updated, strict=True))
        state["model"] = {name: into[id(p)].detach() for name, p in weights.items()}
        state["optimizer"] = {"state": {name: {"step": torch.zeros(()), "exp_avg": torch.zeros_like(into[id(p)]),
                                               "exp_avg_sq": torch.zeros_like(into[id(p)])}
                                        for name, p in weights.items()}}
    with warnings.catch_warnings():  # DCP's note that it reads in a single process: that is the intent here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(state, checkpoint_id=str(path))
    if optimizer is None:
        return
    order = {id(p): i for i, p in enumerate(optimizer.params)}
    group = {key: value for key, value in optimizer.adamw.param_groups[0].items() if key != "params"}
    optimizer.adamw.load_state_dict({
        "state": {order[id(p)]: state["optimizer"]["state"][name] for name, p in weights.items()},
        "param_groups": [group | {"params": list(range(len(optimizer.params)))}],
    })
    for p, master in zip(optimizer.params, optimizer.masters, strict=True):
        if master is not None:
            p.copy_(master)
