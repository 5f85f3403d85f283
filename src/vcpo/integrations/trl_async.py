"""vcpo inside TRL's asynchronous GRPO trainer (``trl.experimental.async_grpo``, extra ``trl``):
``VCPOAsyncGRPOTrainer`` trains any vcpo objective on the sampler's per-token log-probs, with OPOB advantages over
each group and the ESS-scaled learning rate (VCPO, arXiv 2602.17616, §8.2-8.3); ``LocalRolloutWorker`` and
``LocalWeightTransfer`` are TRL's rollout and weight-sync protocols on vcpo's in-process engine, so TRL's whole
asynchronous loop runs on a CPU. docs/integrations.md says what runs and what is lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from vcpo.integrations.trl import ESSLearningRateCallback, check_vcpo_arguments, fill_unscored_rewards
from vcpo.integrations.trl_local import (
    LocalRolloutWorker,
    LocalWeightTransfer,
    unknown_peak_flops_without_cuda,
    use_reference_tree_attention,
)
from vcpo.objective_specs import SUM_NORM
from vcpo.objectives import ObjectiveInputs
from vcpo.objectives.registry import objective_scope
from vcpo.variance import (
    logit_proxy_grad_sq_norms,
    opob_advantages,
    opob_rows_needing_grad_norms,
    sequence_log_weights,
    token_logprobs,
    trajectory_grad_sq_norms,
)

__all__ = ["LocalRolloutWorker", "LocalWeightTransfer", "OPOBGroup", "VCPOAsyncGRPOTrainer"]


@contextlib.contextmanager
def standard_attention(model: nn.Module) -> Iterator[None]:
    """The model with SDPA attention on padded [B, S] batches for the duration (TRL builds it with tree attention,
    which only TRL's packed forward can call), then tree attention again."""
    config = model.config
    packed = config._attn_implementation
    config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = packed


def right_padded(rows: Sequence[np.ndarray], dtype: torch.dtype, pad: float = 0) -> Tensor:
    """[B, S] tensor of 1-D arrays of different lengths, right-padded with ``pad``."""
    out_BS = torch.full((len(rows), max(len(r) for r in rows)), pad, dtype=dtype)
    for b, row in enumerate(rows):
        out_BS[b, : len(row)] = torch.as_tensor(row, dtype=dtype)
    return out_BS


def tokens_by_sequence(values_M: Tensor, segment_id_M: Tensor) -> tuple[Tensor, Tensor]:
    """``([S, T] values, [S, T] mask)`` from the flat loss terms of one packed row (``segment_id`` non-decreasing,
    each sample's terms in token order, as TRL's ``TreeRow.pack`` lays them out); differentiable in the values."""
    if segment_id_M.numel() > 1 and bool((segment_id_M.diff() < 0).any()):
        raise ValueError("tokens_by_sequence: segment_id must be non-decreasing (TRL's packed layout)")
    counts_S = torch.bincount(segment_id_M)
    starts_S = counts_S.cumsum(0) - counts_S
    position_M = torch.arange(segment_id_M.numel(), device=segment_id_M.device) - starts_S[segment_id_M]
    T = int(counts_S.max()) if counts_S.numel() else 0
    values_ST = values_M.new_zeros(counts_S.numel(), T).index_put((segment_id_M, position_M), values_M)
    mask_ST = torch.arange(T, device=counts_S.device)[None, :] < counts_S[:, None]
    return values_ST, mask_ST


@dataclasses.dataclass(frozen=True)
class OPOBGroup:
    """One group's OPOB advantages and what they were computed from: rewards (NaN unscored), W and G of the
    trainer's policy at ``trainer_version`` (the version the group was sampled under is ``sample_version``), the
    advantages trained on and the rollout worker's own."""

    rewards_G: Tensor
    logw_G: Tensor
    grad_sq_norms_G: Tensor
    advantages_G: Tensor
    worker_advantages_G: Tensor
    sample_version: int
    trainer_version: int


class OPOBRolloutQueue:
    """The rollout queue as TRL's ``RolloutQueueDataset`` reads it (``get`` with a timeout, ``qsize``), where each
    sample leaves with OPOB's advantage in place of the worker's: samples wait until their group has
    ``group_size`` rows, then ``advantages`` of the whole group replaces theirs."""

    def __init__(self, source: Any, group_size: int, advantages: Callable[[list[RolloutSample]], Tensor]) -> None:
        self.source, self.group_size, self.advantages = source, group_size, advantages
        self.waiting: dict[int, list[RolloutSample]] = {}
        self.ready: deque[RolloutSample] = deque()

    def qsize(self) -> int:
        return self.source.qsize() + len(self.ready)

    def get(self, timeout: float | None = None) -> RolloutSample:
        while not self.ready:
            sample = self.source.get(timeout=timeout)  # queue.Empty: TRL checks the worker's health and asks again
            group = self.waiting.setdefault(sample.group_id, [])
            group.append(sample)
            if len(group) == self.group_size:
                del self.waiting[sample.group_id]
                advantages_G = self.advantages(group)
                self.ready.extend(dataclasses.replace(s, advantage=float(a)) for s, a in zip(group, advantages_G,
                                                                                              strict=True))
        return self.ready.popleft()


class _KeepOutputs:
    """The model as TRL's ``compute_loss`` calls it, keeping the forward's outputs for the vcpo loss."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.outputs = model, None

    def __call__(self, **kwargs: Any) -> Any:
        self.outputs = self.model(**kwargs)
        return self.outputs


class VCPOAsyncGRPOTrainer(AsyncGRPOTrainer):
    """TRL's AsyncGRPOTrainer with a vcpo objective, OPOB advantages and the ESS-scaled learning rate.

    The vcpo arguments (keyword) are ``VCPOGRPOTrainer``'s: ``objective``, ``objective_kwargs``,
    ``advantage_estimator`` (``"opob"`` or ``"trl"``: the rollout worker's advantages), ``opob_variant`` (default
    ``"grad_only"``), ``grad_norm_method`` (``"logit_proxy"``, ``"exact"`` or ``"fast"``), ``ess_lr_rule`` and
    ``ess_lr_reference``. With a ``LocalRolloutWorker`` and no ``weight_transfer``, a ``LocalWeightTransfer`` of
    that worker is used.

    - **Advantages** (``"opob"``): when a group's ``num_generations`` samples have left the rollout queue (TRL's
      dataset pulls them), ``opob_advantages(R, logW, G, group)`` of the group replaces the worker's, R the
      sample's ``reward`` metric, ``logW_i = sum_t (log pi_theta - log mu)`` of the trainer's policy now over the
      sampler's log-probs, G from ``grad_norm_method`` on the trainer's policy (eval mode, SDPA attention).
    - **Loss**: TRL's ``compute_loss`` runs its packed forward (and logs its own diagnostics of the batch: ratio,
      kl, entropy, clip fractions); its PPO-clip loss is dropped and the vcpo objective runs on the same log-probs,
      per sequence of the micro-batch against the sampler's (bypass mode), divided by the accumulation steps.
    - **Learning rate**: ``ESSLearningRateCallback`` scales each optimizer step by the ESS rule of the step's
      sequence log-weights; ``ess/ratio`` and ``lr_scale`` go to TRL's metrics, beside TRL's own
      ``sample/staleness_mean`` and ``sample/staleness_max`` (versions behind, per sample).

    ``last_opob`` holds the latest group's ``OPOBGroup``. Objectives whose loss depends on other rows (scope
    ``group`` or ``batch``: ``tb``, ``bapo``, ``m2po``) are refused: a micro-batch here is whatever the planner
    packed. A row's raw reward does not reach the loss (TOPR tapers on the advantage's sign).
    """

    def __init__(
        self, *args: Any, objective: str = "vcpo", objective_kwargs: Mapping[str, Any] | None = None,
        advantage_estimator: str = "opob", opob_variant: str = "grad_only", grad_norm_method: str = "logit_proxy",
        ess_lr_rule: str | None = "sqrt", ess_lr_reference: float = 1.0, **kwargs: Any,
    ) -> None:
        self.vcpo_objective, self.vcpo_objective_kwargs = check_vcpo_arguments(
            objective, objective_kwargs, advantage_estimator, opob_variant, grad_norm_method)
        if objective_scope(objective) != "row":
            raise ValueError(f"objective {objective!r} is {objective_scope(objective)}-scoped: VCPOAsyncGRPOTrainer "
                             "runs only objectives whose loss of a row depends on that row alone")
        if advantage_estimator == "opob" and (kwargs.get("tools") or kwargs.get("environment_factory")):
            raise ValueError("advantage_estimator='opob' needs groups of num_generations rows; tools and "
                             "environment_factory fork conversations into more rows")
        worker = kwargs.get("rollout_worker")
        if isinstance(worker, LocalRolloutWorker) and kwargs.get("weight_transfer") is None:
            kwargs["weight_transfer"] = LocalWeightTransfer(worker)
        self.advantage_estimator, self.opob_variant, self.grad_norm_method = (
            advantage_estimator, opob_variant, grad_norm_method)
        self.last_opob: OPOBGroup | None = None
        with unknown_peak_flops_without_cuda():
            super().__init__(*args, **kwargs)
        use_reference_tree_attention()
        if isinstance(worker, LocalRolloutWorker) and worker.num_generations != self.args.num_generations:
            raise ValueError(f"the rollout worker makes groups of {worker.num_generations}, args.num_generations is "
                             f"{self.args.num_generations}")
        if self.vcpo_objective_kwargs.get("loss_agg") == SUM_NORM and "max_len" not in self.vcpo_objective_kwargs:
            self.vcpo_objective_kwargs["max_len"] = self.args.max_completion_length
        if advantage_estimator == "opob" and self.rollout_queue is not None:
            self.rollout_queue = OPOBRolloutQueue(self.rollout_queue, self.args.num_generations, self.opob)
        self.ess_lr = None
        if ess_lr_rule is not None:
            self.ess_lr = ESSLearningRateCallback(self._metrics["train"], ess_lr_rule, ess_lr_reference)
            self.add_callback(self.ess_lr)

    def opob(self, samples: list[RolloutSample]) -> Tensor:
        """[G] OPOB advantages of one group; unscored rows get 0 (``fill_unscored_rewards``). A group more than
        ``max_staleness`` versions old keeps the worker's: TRL's dataset drops it as it leaves the queue."""
        if self.model_version - min(s.model_version for s in samples) > self.args.max_staleness:
            return torch.tensor([s.advantage for s in samples], dtype=torch.float64)
        rewards_G = torch.tensor([s.metrics["reward"] for s in samples], dtype=torch.float64)
        group_ids_G = torch.zeros(len(samples), dtype=torch.long)
        filled_G, unscored_G = fill_unscored_rewards(rewards_G, group_ids_G)
        input_ids_GS = right_padded([s.input_ids for s in samples], torch.long)
        attention_mask_GS = right_padded([np.ones_like(s.input_ids) for s in samples], torch.long)
        response_mask_GS = right_padded([s.completion_mask for s in samples], torch.long)
        behaviour_GS = right_padded([s.old_log_probs for s in samples], torch.float64)
        needed_G = opob_rows_needing_grad_norms(filled_G, group_ids_G)
        logw_G, G_G = self.log_weights_and_grad_sq_norms(input_ids_GS, attention_mask_GS, response_mask_GS,
                                                         behaviour_GS, needed_G)
        advantages_G = opob_advantages(filled_G, logw_G, G_G, group_ids_G, variant=self.opob_variant)
        advantages_G = torch.where(unscored_G, 0.0, advantages_G)
        self._metrics["train"]["opob/grad_sq_norm_mean"].append(float(G_G[needed_G].mean()) if needed_G.any()
                                                                else 0.0)
        self.last_opob = OPOBGroup(rewards_G, logw_G, G_G, advantages_G,
                                   torch.tensor([s.advantage for s in samples], dtype=torch.float64),
                                   min(s.model_version for s in samples), self.model_version)
        return advantages_G

    def log_weights_and_grad_sq_norms(self, input_ids_GS: Tensor, attention_mask_GS: Tensor,
                                      response_mask_GS: Tensor, behaviour_GS: Tensor,
                                      needed_G: Tensor) -> tuple[Tensor, Tensor]:
        """[G] float64 ``logW`` of the trainer's policy over the sampler's and G of the rows ``needed_G`` (0
        elsewhere), at the sampling temperature, in eval mode (no dropout), SDPA attention on the padded group."""
        model = self.accelerator.unwrap_model(self.model)
        device = next(model.parameters()).device
        ids, attention, response = (t.to(device) for t in (input_ids_GS, attention_mask_GS, response_mask_GS))
        was_training = model.training
        model.eval()
        try:
            with standard_attention(model):
                with torch.no_grad():
                    lp_GS, _, collision_GS = token_logprobs(model, ids, attention, self.temperature,
                                                            positions=response, return_collision=True)
                if self.grad_norm_method == "logit_proxy":
                    G_G = logit_proxy_grad_sq_norms(lp_GS, collision_GS, response, self.temperature)
                else:
                    G_G = torch.zeros(ids.shape[0], dtype=torch.float64, device=device)
                    if bool(needed_G.any()):
                        G_G[needed_G] = trajectory_grad_sq_norms(
                            model, ids[needed_G], response[needed_G], attention[needed_G],
                            method=self.grad_norm_method).double()
        finally:
            model.train(was_training)
        logw_G = sequence_log_weights(lp_GS.double().cpu(), behaviour_GS, response_mask_GS)
        return logw_G, torch.where(needed_G, G_G.cpu(), torch.zeros_like(G_G.cpu()))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None) -> Tensor:
        """The vcpo objective on one packed micro-batch, per sequence against the sampler's log-probs, divided by
        the accumulation steps; the sequences' log-weights go to the ESS learning rate."""
        forward = _KeepOutputs(model)
        super().compute_loss(forward, inputs)  # TRL's forward and diagnostics; its PPO-clip loss is not used
        selected_P = inputs["token_index"] >= 0
        lp_M = forward.outputs.log_probs.flatten()[inputs["token_index"][selected_P]].float()
        segment_id_M = inputs["segment_id"][selected_P]
        lp_ST, mask_ST = tokens_by_sequence(lp_M, segment_id_M)
        behaviour_ST, _ = tokens_by_sequence(inputs["old_log_probs"][selected_P].float(), segment_id_M)
        advantages_ST, _ = tokens_by_sequence(inputs["advantages"][selected_P].float(), segment_id_M)
        objective_inputs = ObjectiveInputs(logprobs=lp_ST, behavior_logprobs=behaviour_ST,
                                           advantages=advantages_ST[:, 0], mask=mask_ST)
        out = self.vcpo_objective(objective_inputs, **self.vcpo_objective_kwargs)
        logw_S = sequence_log_weights(lp_ST, behaviour_ST, mask_ST)
        gathered_logw = self.accelerator.gather(torch.where(mask_ST.any(dim=1), logw_S, torch.nan))
        gathered_logw = gathered_logw[~torch.isnan(gathered_logw)]
        if self.ess_lr is not None and gathered_logw.numel():
            self.ess_lr.record(gathered_logw)
        metrics = {key: value for key, value in out.metrics.items() if key != "ess/ratio"}
        metrics["is/logw_abs_max"] = float(gathered_logw.abs().max()) if gathered_logw.numel() else 0.0
        for key, value in metrics.items():
            self._metrics["train"][key].append(value)
        if self.aux_loss_enabled:  # the MoE load-balancing loss TRL's own loss adds
            out_loss = out.loss + self.router_aux_loss_coef * forward.outputs.aux_loss
        else:
            out_loss = out.loss
        return out_loss / self.current_gradient_accumulation_steps
