"""vcpo inside TRL's ``GRPOTrainer`` (extra ``trl``): ``VCPOGRPOTrainer`` trains with any vcpo objective on the
behaviour log-probs TRL keeps, replaces TRL's group-normalised advantages by OPOB's over the whole generated batch,
and scales each optimizer step's learning rate by the ESS ratio (``ESSLearningRateCallback``; VCPO, arXiv
2602.17616, §8.2-8.3). Everything vcpo changes in TRL is in this file; docs/integrations.md says what is lost.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from vcpo.objective_specs import SUM_NORM, check_hyperparameters
from vcpo.objectives import ObjectiveInputs, get_objective
from vcpo.variance import (
    GRAD_SQ_NORM_METHODS,
    OPOB_VARIANTS,
    ess_lr_scale,
    ess_ratio,
    logit_proxy_grad_sq_norms,
    opob_advantages,
    opob_rows_needing_grad_norms,
    sequence_log_weights,
    token_logprobs,
    trajectory_grad_sq_norms,
)

ADVANTAGE_ESTIMATORS = ("opob", "trl")
"""``opob``: VCPO's off-policy optimal baseline over each generated batch; ``trl``: TRL's own advantages."""
GRAD_NORM_METHODS = ("logit_proxy", *GRAD_SQ_NORM_METHODS)
"""How OPOB's G_i is measured: the forward-only logit proxy, or the per-row norms of ``trajectory_grad_sq_norms``."""
IGNORED_LOSS_OPTIONS = ("loss_type", "beta", "epsilon", "epsilon_high", "delta", "importance_sampling_level")
"""``GRPOConfig`` options of TRL's own loss, which the vcpo objective replaces (``beta`` still makes TRL compute the
reference log-probs, which ``tb`` reads)."""


def ignored_loss_options(args: GRPOConfig, objective: str) -> dict[str, Any]:
    """The options of ``IGNORED_LOSS_OPTIONS`` that ``args`` sets away from GRPOConfig's defaults (``beta`` not for
    ``tb``, which reads the reference log-probs it makes TRL compute)."""
    defaults = {f.name: f.default for f in fields(GRPOConfig)}
    return {name: getattr(args, name) for name in IGNORED_LOSS_OPTIONS
            if getattr(args, name) != defaults[name] and not (name == "beta" and objective == "tb")}


def behaviour_logprobs(inputs: Mapping[str, Any], logprobs_BT: Tensor) -> Tensor:
    """[B, T] log mu of the sampled tokens from what TRL keeps in a batch: the generator's own log-probs
    (``sampling_per_token_logps``: vLLM or a ``rollout_func``), where one is NaN (a token vLLM could not score) the
    trainer's policy at generation (``old_per_token_logps``, kept when a batch is reused), and when TRL kept neither
    the current policy itself (detached: W = 1, on-policy)."""
    current_BT = logprobs_BT.detach()
    old_BT = inputs.get("old_per_token_logps")
    fallback_BT = current_BT if old_BT is None else old_BT
    sampled_BT = inputs.get("sampling_per_token_logps")
    if sampled_BT is None:
        return fallback_BT
    return torch.where(torch.isnan(sampled_BT), fallback_BT, sampled_BT)


def check_vcpo_arguments(
    objective: str, objective_kwargs: Mapping[str, Any] | None, advantage_estimator: str, opob_variant: str,
    grad_norm_method: str,
) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The objective and its checked hyperparameters; a ValueError naming the first bad vcpo argument."""
    objective_fn = get_objective(objective)  # ValueError listing the names
    kwargs = check_hyperparameters(objective, dict(objective_kwargs or {}))
    if advantage_estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage_estimator must be one of {', '.join(ADVANTAGE_ESTIMATORS)}, "
                         f"got {advantage_estimator!r}")
    if opob_variant not in OPOB_VARIANTS:
        raise ValueError(f"opob_variant must be one of {', '.join(OPOB_VARIANTS)}, got {opob_variant!r}")
    if grad_norm_method not in GRAD_NORM_METHODS:
        raise ValueError(f"grad_norm_method must be one of {', '.join(GRAD_NORM_METHODS)}, "
                         f"got {grad_norm_method!r}")
    return objective_fn, kwargs


def fill_unscored_rewards(rewards_N: Tensor, group_ids_N: Tensor) -> tuple[Tensor, Tensor]:
    """``(filled_N, unscored_N)``: a NaN reward (no reward function scored the row) replaced by its group's mean
    reward over the scored rows (0 in a group with none), so that it moves neither its group's baseline nor std."""
    unscored_N = torch.isnan(rewards_N)
    _, inverse_N = torch.unique(group_ids_N, return_inverse=True)
    sums_G = torch.zeros(int(inverse_N.max()) + 1, dtype=rewards_N.dtype, device=rewards_N.device).index_add_(
        0, inverse_N, torch.where(unscored_N, 0.0, rewards_N))
    counts_G = torch.zeros_like(sums_G).index_add_(0, inverse_N, (~unscored_N).to(rewards_N.dtype))
    return torch.where(unscored_N, (sums_G / counts_G.clamp(min=1))[inverse_N], rewards_N), unscored_N


class ESSLearningRateCallback(TrainerCallback):
    """Scales each optimizer step's learning rate by VCPO's ESS rule (§8.2), then restores the scheduler's.

    ``record`` keeps the sequence log-weights of every micro-batch of the coming step; ``on_pre_optimizer_step``
    sets each parameter group's ``lr`` to ``lr * ess_lr_scale(rho, reference, rule)`` with ``rho = ESS / B`` of
    those log-weights, and ``on_optimizer_step`` puts the scheduler's value back, so the scheduler never sees the
    scale (the step size, not the gradient, is scaled: Adam would undo a gradient scale). ``ess/ratio`` and
    ``lr_scale`` are appended to ``metrics`` (TRL's per-mode metric lists). A step with nothing recorded is left
    alone.
    """

    def __init__(self, metrics: dict[str, list[float]], rule: str = "sqrt", reference: float = 1.0) -> None:
        ess_lr_scale(1.0, reference, rule)  # ValueError naming a bad rule or reference, now
        self.metrics, self.rule, self.reference = metrics, rule, reference
        self.logw: list[Tensor] = []
        self.scheduled_lrs: list[float] | None = None

    def record(self, logw_B: Tensor) -> None:
        """Keep one micro-batch's sequence log-weights (its rows with at least one counted token)."""
        self.logw.append(logw_B.detach().double().cpu())

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs) -> None:
        if not self.logw:
            return
        rho = float(ess_ratio(torch.cat(self.logw)))
        scale = ess_lr_scale(rho, self.reference, self.rule)
        self.scheduled_lrs = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * scale
        self.metrics["ess/ratio"].append(rho)
        self.metrics["lr_scale"].append(scale)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs) -> None:
        if self.scheduled_lrs is not None:
            for group, lr in zip(optimizer.param_groups, self.scheduled_lrs, strict=True):
                group["lr"] = lr
        self.scheduled_lrs = None
        self.logw.clear()


@dataclass(frozen=True)
class OPOBBatch:
    """One generated batch's OPOB advantages and what they were computed from (N rows over all processes; the
    token tensors are this process's rows). ``trl_advantages_N`` are TRL's own on the same rewards."""

    rewards_N: Tensor
    group_ids_N: Tensor
    logw_N: Tensor
    grad_sq_norms_N: Tensor
    advantages_N: Tensor
    trl_advantages_N: Tensor
    input_ids_BS: Tensor
    attention_mask_BS: Tensor
    response_mask_BS: Tensor


class VCPOGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with a vcpo objective, OPOB advantages and the ESS-scaled learning rate.

    Arguments beyond GRPOTrainer's (all keyword):
    - ``objective``: a vcpo objective name (``list_objectives()``) or a user objective's import path;
      ``objective_kwargs`` its hyperparameters (``loss_agg`` included; ``max_len`` defaults to
      ``max_completion_length``). The objective's loss on each micro-batch, divided by the gradient accumulation
      steps, replaces TRL's loss (its KL term, entropy bonus, clipping modes and loss types are not applied).
    - ``advantage_estimator``: ``"opob"`` (default) or ``"trl"`` (TRL's group-normalised advantages).
      ``opob_variant`` (default ``"grad_only"``: weights G_i, no W, as W = 1 at generation unless a generator
      returned its own log-probs) and ``grad_norm_method`` (``"logit_proxy"``, default, one forward without
      gradient; ``"exact"``, one backward per row; ``"fast"``, ghost norms) choose how (``opob_advantages``).
    - ``ess_lr_rule``: ``"sqrt"`` (default), ``"linear"`` or None (off), with ``ess_lr_reference``. Refused with
      DeepSpeed, whose step accelerate takes inside ``backward()``, out of the callback's reach.

    TRL's loss options set away from their defaults (``IGNORED_LOSS_OPTIONS``) get one warning: they do nothing.
    ``last_opob`` holds the latest generated batch's ``OPOBBatch``.
    """

    def __init__(
        self, *args: Any, objective: str = "vcpo", objective_kwargs: Mapping[str, Any] | None = None,
        advantage_estimator: str = "opob", opob_variant: str = "grad_only", grad_norm_method: str = "logit_proxy",
        ess_lr_rule: str | None = "sqrt", ess_lr_reference: float = 1.0, **kwargs: Any,
    ) -> None:
        self.vcpo_objective, self.vcpo_objective_kwargs = check_vcpo_arguments(
            objective, objective_kwargs, advantage_estimator, opob_variant, grad_norm_method)
        self.advantage_estimator, self.opob_variant, self.grad_norm_method = (
            advantage_estimator, opob_variant, grad_norm_method)
        self.last_opob: OPOBBatch | None = None
        self.rewards_per_func: Tensor | None = None
        super().__init__(*args, **kwargs)
        if self.vcpo_objective_kwargs.get("loss_agg") == SUM_NORM and "max_len" not in self.vcpo_objective_kwargs:
            self.vcpo_objective_kwargs["max_len"] = self.max_completion_length
        if advantage_estimator == "opob" and self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError("advantage_estimator='opob' takes the weighted sum of the rewards; "
                             "multi_objective_aggregation must be 'sum_then_normalize'")
        ignored = ignored_loss_options(self.args, objective)
        if ignored:
            warnings.warn(f"VCPOGRPOTrainer ignores {', '.join(f'{k}={v!r}' for k, v in ignored.items())}: the vcpo "
                          f"objective {objective!r} replaces TRL's loss", UserWarning, stacklevel=2)
        self.ess_lr = None
        if ess_lr_rule is not None and self.is_deepspeed_enabled:
            raise ValueError("ess_lr_rule with DeepSpeed: accelerate takes DeepSpeed's optimizer step inside "
                             "backward(), where the ESS learning rate cannot reach it; set ess_lr_rule=None")
        if ess_lr_rule is not None:
            self.ess_lr = ESSLearningRateCallback(self._metrics["train"], ess_lr_rule, ess_lr_reference)
            self.add_callback(self.ess_lr)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list) -> Tensor:
        """TRL's rewards of every process's completions ([N, reward functions]), kept for OPOB."""
        self.rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self.rewards_per_func

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's generated batch with each row's reward and group id added (for the objectives that read them)
        and, in training with ``advantage_estimator="opob"``, OPOB's advantages in place of TRL's."""
        batch = super()._generate_and_score_completions(inputs)
        rewards_N = (self.rewards_per_func * self.reward_weights.to(self.rewards_per_func.device)).nansum(dim=1)
        unscorable_N = torch.isnan(self.rewards_per_func).all(dim=1)
        group_ids_N = torch.arange(rewards_N.shape[0], device=rewards_N.device) // self.num_generations
        local = self.local_rows(batch["advantages"].shape[0])
        batch["vcpo_rewards"] = rewards_N[local].to(batch["advantages"].device)
        batch["vcpo_group_ids"] = group_ids_N[local].to(batch["advantages"].device)
        if self.advantage_estimator == "opob" and self.model.training:
            self.last_opob = self.opob(batch, rewards_N, unscorable_N, group_ids_N)
            batch["advantages"] = self.last_opob.advantages_N[local].to(batch["advantages"])
            logged = self._logs["advantages"]  # TRL's completions table shows the advantages trained on
            for _ in range(min(rewards_N.shape[0], len(logged))):
                logged.pop()
            logged.extend(self.last_opob.advantages_N.tolist())
        return batch

    def local_rows(self, n_local: int) -> slice:
        """This process's rows among the N gathered ones (TRL's order: process by process)."""
        start = self.accelerator.process_index * n_local
        return slice(start, start + n_local)

    def opob(self, batch: dict[str, Any], rewards_N: Tensor, unscorable_N: Tensor, group_ids_N: Tensor) -> OPOBBatch:
        """OPOB advantages of the whole generated batch: G_i of this process's rows, gathered with every process's,
        then ``opob_advantages`` over all N rows. A row no reward function scored gets advantage 0 and stands in
        its group's baseline and std with the group's mean reward; W is the trainer's policy at generation
        (``old_per_token_logps``, else the policy now: TRL keeps none for a fresh batch) over the generator's
        (``sampling_per_token_logps``: vLLM or a ``rollout_func``; 1 when TRL samples with the trainer's model)."""
        filled_N, _ = fill_unscored_rewards(torch.where(unscorable_N, torch.nan, rewards_N), group_ids_N)
        tool_mask = batch.get("tool_mask")
        completion_mask_BC = batch["completion_mask"] if tool_mask is None else batch["completion_mask"] * tool_mask
        input_ids_BS = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        attention_mask_BS = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        response_mask_BS = torch.cat([torch.zeros_like(batch["prompt_mask"]), completion_mask_BC], dim=1)
        local = self.local_rows(input_ids_BS.shape[0])
        needed_B = opob_rows_needing_grad_norms(filled_N, group_ids_N)[local].to(input_ids_BS.device)
        G_B = self.grad_sq_norms(input_ids_BS, attention_mask_BS, response_mask_BS, needed_B)
        logw_B = torch.zeros(input_ids_BS.shape[0], dtype=torch.float64, device=input_ids_BS.device)
        sampled_BC = batch.get("sampling_per_token_logps")
        if sampled_BC is not None:
            policy_BC = batch.get("old_per_token_logps")
            if policy_BC is None:  # TRL kept none: a fresh batch, whose policy at generation is the trainer's now
                prompt_width = batch["prompt_ids"].shape[1]
                policy_BC = self.policy_logprobs(input_ids_BS, attention_mask_BS, response_mask_BS)[:, prompt_width:]
            logw_B = sequence_log_weights(policy_BC.double(), torch.nan_to_num(sampled_BC.double()),
                                          completion_mask_BC * ~torch.isnan(sampled_BC))
        G_N = self.accelerator.gather(G_B).to(rewards_N.device, torch.float64)
        logw_N = self.accelerator.gather(logw_B).to(rewards_N.device, torch.float64)
        advantages_N = opob_advantages(filled_N.double(), logw_N, G_N, group_ids_N, variant=self.opob_variant)
        advantages_N = torch.where(unscorable_N, 0.0, advantages_N)
        self._metrics["train"]["opob/grad_sq_norm_mean"].append(float(G_N[G_N > 0].mean()) if (G_N > 0).any() else 0.0)
        all_local = self.accelerator.gather(batch["advantages"]).to(rewards_N.device)
        return OPOBBatch(rewards_N, group_ids_N, logw_N, G_N, advantages_N, all_local, input_ids_BS,
                         attention_mask_BS, response_mask_BS)

    def policy_logprobs(self, input_ids_BS: Tensor, attention_mask_BS: Tensor, response_mask_BS: Tensor) -> Tensor:
        """[B, S] log-probs of the response tokens under the trainer's policy at the sampling temperature (0
        elsewhere), without gradient, in eval mode, a micro-batch of rows at a time."""
        model = self.accelerator.unwrap_model(self.model)
        was_training = model.training
        model.eval()
        step = self.args.per_device_train_batch_size
        chunks_bS = []
        try:
            with torch.no_grad():
                for start in range(0, input_ids_BS.shape[0], step):
                    rows = slice(start, start + step)
                    chunks_bS.append(token_logprobs(model, input_ids_BS[rows], attention_mask_BS[rows],
                                                    self.temperature, positions=response_mask_BS[rows]))
        finally:
            model.train(was_training)
        return torch.cat(chunks_bS)

    def grad_sq_norms(self, input_ids_BS: Tensor, attention_mask_BS: Tensor, response_mask_BS: Tensor,
                      needed_B: Tensor) -> Tensor:
        """[B] float64 G_i of the rows ``needed_B`` (0 elsewhere), at the sampling temperature for the proxy, with
        the model in eval mode (no dropout), a micro-batch of rows at a time for the proxy."""
        model = self.accelerator.unwrap_model(self.model)
        was_training = model.training
        model.eval()
        G_B = torch.zeros(needed_B.shape, dtype=torch.float64, device=input_ids_BS.device)
        try:
            if self.grad_norm_method == "logit_proxy":
                step = self.args.per_device_train_batch_size
                for start in range(0, input_ids_BS.shape[0], step):
                    rows = slice(start, start + step)
                    with torch.no_grad():
                        lp_bS, _, collision_bS = token_logprobs(
                            model, input_ids_BS[rows], attention_mask_BS[rows], self.temperature,
                            positions=response_mask_BS[rows], return_collision=True)
                    G_B[rows] = logit_proxy_grad_sq_norms(lp_bS, collision_bS, response_mask_BS[rows], self.temperature)
            elif bool(needed_B.any()):
                G_B[needed_B] = trajectory_grad_sq_norms(
                    model, input_ids_BS[needed_B], response_mask_BS[needed_B], attention_mask_BS[needed_B],
                    method=self.grad_norm_method).to(G_B.dtype)
        finally:
            model.train(was_training)
        return torch.where(needed_B, G_B, torch.zeros_like(G_B))

    def _compute_loss(self, model, inputs: dict[str, Any]) -> Tensor:
        """The vcpo objective on one micro-batch of the reused generated batch, divided by the accumulation steps;
        the step's sequence log-weights go to the ESS learning rate, the objective's diagnostics to TRL's metrics."""
        if "pixel_values" in inputs:
            raise NotImplementedError("VCPOGRPOTrainer trains text models only")
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        tool_mask = inputs.get("tool_mask")
        mask_BT = inputs["completion_mask"] if tool_mask is None else inputs["completion_mask"] * tool_mask
        lp_BT, entropy_BT, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True)
        lp_BT = lp_BT.float()
        objective_inputs = ObjectiveInputs(
            logprobs=lp_BT, behavior_logprobs=behaviour_logprobs(inputs, lp_BT).float(),
            advantages=inputs["advantages"].float(), mask=mask_BT, rewards=inputs["vcpo_rewards"].float(),
            group_ids=inputs["vcpo_group_ids"], ref_logprobs=inputs.get("ref_per_token_logps"))
        out = self.vcpo_objective(objective_inputs, **self.vcpo_objective_kwargs)
        mode = "train" if self.model.training else "eval"
        nonempty_B = mask_BT.sum(dim=1) > 0
        logw_B = sequence_log_weights(objective_inputs.logprobs, objective_inputs.behavior_logprobs, mask_BT)
        gathered_logw = self.accelerator.gather(torch.where(nonempty_B, logw_B, torch.nan))
        gathered_logw = gathered_logw[~torch.isnan(gathered_logw)]
        if mode == "train" and self.ess_lr is not None and gathered_logw.numel():
            self.ess_lr.record(gathered_logw)
        # The micro-batch's ESS stays out: ess/ratio is the optimizer step's, logged by the callback.
        metrics = {key: value for key, value in out.metrics.items() if key != "ess/ratio"}
        metrics["is/logw_abs_max"] = float(gathered_logw.abs().max()) if gathered_logw.numel() else 0.0
        metrics["entropy"] = float(entropy_BT.detach()[mask_BT.bool()].mean()) if bool(mask_BT.any()) else 0.0
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)
        return out.loss / (self.current_gradient_accumulation_steps if mode == "train" else 1.0)


ASYNC_NAMES = ("LocalRolloutWorker", "LocalWeightTransfer", "VCPOAsyncGRPOTrainer")
"""TRL's asynchronous trainer's pieces, in vcpo.integrations.trl_async (imported on first use: it imports this)."""


def __getattr__(name: str) -> Any:
    if name in ASYNC_NAMES:
        from vcpo.integrations import trl_async

        return getattr(trl_async, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
