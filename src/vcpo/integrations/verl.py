"""vcpo inside verl: every vcpo objective registered as a verl policy loss ``vcpo_<objective>`` (verl's global
normaliser honoured), ``ESSAdamW``, an AdamW that verl's ``build_optimizer`` constructs and that scales each step's
learning rate by the ESS ratio of the log-weights its step's losses saw (VCPO, arXiv 2602.17616, §8.2), and
``compute_opob_advantage``, OPOB with the logit proxy on a DataProto for a trainer that calls it (§8.3), with
``add_policy_log_probs`` for verl's bypass mode. Loaded by
``actor_rollout_ref.model.external_lib=vcpo.integrations.verl`` or the ``verl.plugins`` entry point. Everything vcpo
changes in verl is in this file; docs/integrations.md says what verl passes and what it does not.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from verl import DataProto
from verl.trainer.ppo.core_algos import register_policy_loss

from vcpo.objective_specs import SUM_NORM, check_hyperparameters
from vcpo.objectives import ObjectiveInputs, get_objective, list_objectives, normaliser_count, objective_scope
from vcpo.variance import ess_lr_scale, logit_proxy_grad_sq_norms, opob_advantages, sequence_log_weights

LOSS_PREFIX = "vcpo_"
POLICY_LOG_PROBS = "vcpo_policy_log_probs"
"""Where ``add_policy_log_probs`` puts the current policy's log-probs in a ``DataProto`` (bypass mode keeps
``old_log_probs`` for the rollout's)."""


class ESSWindow:
    """The sequence log-weights the policy losses of this process saw since the last ``ESSAdamW`` step.

    verl gives a policy loss no way to reach the optimizer, so the two meet here; nothing is kept until an
    ``ESSAdamW`` exists in the process."""

    def __init__(self) -> None:
        self.active = False
        self.logw: list[Tensor] = []

    def record(self, logw_B: Tensor) -> None:
        if self.active:
            self.logw.append(logw_B.detach().double())

    def take(self) -> Tensor:
        """The log-weights recorded since the last call ([0] when none), and a fresh window."""
        taken = torch.cat(self.logw) if self.logw else torch.zeros(0, dtype=torch.float64)
        self.logw = []
        return taken


ESS_WINDOW = ESSWindow()


def policy_loss(objective: str, **hyperparameters: Any) -> Callable[..., tuple[Tensor, dict[str, Any]]]:
    """verl's ``PolicyLossFn`` for vcpo ``objective`` with ``hyperparameters`` bound (checked now).

    ``old_log_prob`` is the behaviour policy mu (the rollout's log-probs in verl's bypass mode), ``log_prob`` the
    current one; the objective runs on the micro-batch with verl's ``loss_agg_mode`` (``token-sum`` as token-mean
    times the token count; ``seq-mean-token-sum-norm`` with ``max_len`` = verl's ``loss_scale_factor``, else the
    response length). The micro-batch's loss is then rescaled from its own normaliser to verl's global one,
    ``loss * max(count_local, 1) / count_global * dp_size`` (``batch_num_tokens`` for token modes,
    ``global_batch_size`` for sequence modes; ``normaliser_count``), so that the gradients summed over micro-batches
    and averaged over data-parallel ranks are the global batch's. verl's ``rollout_is_weights`` are refused: vcpo's
    objectives weight by the behaviour policy themselves.

    An objective whose per-row loss depends on the batch (``bapo``, ``m2po``: scope ``batch``) runs only where the
    micro-batch is verl's whole global batch (one data-parallel rank, ``global_batch_size`` rows) and is refused
    otherwise: on a part, its statistic would be the part's. A group-scoped one (``tb``) is refused: verl passes a
    policy loss no prompt ids, so its groups cannot be formed.
    """
    fn = get_objective(objective)
    bound = check_hyperparameters(objective, hyperparameters)
    scope = objective_scope(objective)
    if "loss_agg" in bound or "max_len" in bound:
        raise ValueError("loss_agg and max_len come from verl: set actor.loss_agg_mode (and actor.loss_scale_factor)")

    def loss_fn(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                loss_agg_mode: str = "token-mean", config: Any = None,
                rollout_is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Any]]:
        if rollout_is_weights is not None:
            raise ValueError(f"{LOSS_PREFIX}{objective} weights by the behaviour policy itself: turn off verl's "
                             f"algorithm.rollout_correction.rollout_is")
        if scope == "group":
            raise ValueError(f"{LOSS_PREFIX}{objective} is group-scoped: verl passes a policy loss no prompt ids, so "
                             f"vcpo cannot form its groups; use a row-scoped objective in verl")
        info = dict(getattr(config, "global_batch_info", None) or {})
        rows, whole, ranks = response_mask.shape[0], info.get("global_batch_size"), info.get("dp_size", 1)
        if scope == "batch" and (ranks != 1 or whole != rows):
            raise ValueError(
                f"{LOSS_PREFIX}{objective}'s statistic is over the whole batch, but this micro-batch has {rows} of "
                f"global_batch_size={whole} rows on dp_size={ranks} ranks: run it on one rank with "
                f"ppo_micro_batch_size_per_gpu = ppo_mini_batch_size x rollout.n, or use a row-scoped objective")
        mode = "token-mean" if loss_agg_mode == "token-sum" else loss_agg_mode
        max_len = (info.get("loss_scale_factor") or response_mask.shape[-1]) if mode == SUM_NORM else None
        mask_BT = response_mask.to(log_prob.dtype)
        inputs = ObjectiveInputs(logprobs=log_prob.float(), behavior_logprobs=old_log_prob.float(),
                                 advantages=advantages.float(), mask=mask_BT)
        out = fn(inputs, loss_agg=mode, **({"max_len": int(max_len)} if max_len else {}), **bound)
        local = normaliser_count(mask_BT, mode).clamp(min=1.0)
        token_mode = mode == "token-mean"
        global_count = info.get("batch_num_tokens") if token_mode else info.get("global_batch_size")
        dp_size = info.get("dp_size", 1)
        if loss_agg_mode == "token-sum":
            scale = local * dp_size
        else:
            scale = local / (local if global_count is None else torch.as_tensor(global_count).to(local)) * dp_size
        nonempty_B = mask_BT.sum(dim=1) > 0
        ESS_WINDOW.record(sequence_log_weights(inputs.logprobs, inputs.behavior_logprobs, mask_BT)[nonempty_B])
        metrics = {f"actor/vcpo/{key}": value for key, value in out.metrics.items()}
        return out.loss * scale.to(out.loss.dtype), metrics

    return loss_fn


def register_objective(objective: str, name: str | None = None, **hyperparameters: Any) -> str:
    """Register vcpo ``objective`` (a name or a user objective's import path) with ``hyperparameters`` as verl
    policy loss ``name`` (default ``vcpo_<objective>``); returns the name, for ``actor.policy_loss.loss_mode``."""
    loss_name = name or f"{LOSS_PREFIX}{objective}"
    register_policy_loss(loss_name)(policy_loss(objective, **hyperparameters))
    return loss_name


def ess_ratio_across_ranks(logw_B: Tensor) -> float | None:
    """``ESS / B`` of the log-weights of every data-parallel rank (each rank passes its own; one rank without
    torch.distributed): ``(sum W)^2 / (B sum W^2)`` with ``W = exp(logw - max)``, the max and sums all-reduced.
    None when no rank has a log-weight, 1.0 when one is not finite."""
    m = torch.tensor([logw_B.max().item() if logw_B.numel() else -math.inf], dtype=torch.float64)
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        m = m.to(_collective_device())
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
    if m.item() == -math.inf:
        return None
    if not math.isfinite(m.item()):  # a non-finite log-weight: its gradient is too, and verl skips the step
        return 1.0
    u_B = logw_B.double().cpu() - m.item()
    sums = torch.stack([torch.exp(u_B).sum(), torch.exp(2 * u_B).sum(), torch.tensor(float(u_B.numel()))])
    if distributed:
        sums = sums.to(_collective_device())
        dist.all_reduce(sums)
    total_w, total_w2, n = sums.tolist()
    return total_w**2 / total_w2 / n


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


class ESSAdamW(torch.optim.AdamW):
    """AdamW whose every step uses ``lr * ess_lr_scale(rho, ess_lr_reference, ess_lr_rule)``, ``rho`` the ESS ratio
    (over all data-parallel ranks) of the sequence log-weights the ``vcpo_*`` losses saw since the last step; the
    scheduler's ``lr`` is restored after the step. verl builds it from ``actor.optim.optimizer_impl=
    vcpo.integrations.verl`` and ``actor.optim.optimizer=ESSAdamW``; the rule and reference come through
    ``override_optimizer_config``. ``last_ess_ratio`` and ``last_lr_scale`` hold the last step's.

    A step with no log-weight on any rank (no ``vcpo_*`` loss ran: another ``loss_mode``, or verl's bypass mode
    switched the loss) warns and takes the scheduler's ``lr``. ``zero_grad`` empties the window, so the log-weights
    of a step verl skips (a non-finite gradient norm: it zeroes the gradients instead of stepping) never reach the
    next step's ESS."""

    def __init__(self, params: Any, lr: float = 1e-3, ess_lr_rule: str = "sqrt", ess_lr_reference: float = 1.0,
                 **kwargs: Any) -> None:
        ess_lr_scale(1.0, ess_lr_reference, ess_lr_rule)  # ValueError naming a bad rule or reference, now
        super().__init__(params, lr=lr, **kwargs)
        self.ess_lr_rule, self.ess_lr_reference = ess_lr_rule, ess_lr_reference
        self.last_ess_ratio, self.last_lr_scale = 1.0, 1.0
        ESS_WINDOW.active = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        ESS_WINDOW.take()
        super().zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        rho = ess_ratio_across_ranks(ESS_WINDOW.take())
        if rho is None:
            warnings.warn("ESSAdamW: no vcpo_* policy loss recorded a log-weight since the last step, so this step "
                          "takes the unscaled learning rate; set actor.policy_loss.loss_mode to a vcpo_* loss",
                          RuntimeWarning, stacklevel=3)
        self.last_ess_ratio = 1.0 if rho is None else rho
        self.last_lr_scale = ess_lr_scale(self.last_ess_ratio, self.ess_lr_reference, self.ess_lr_rule)
        scheduled = [group["lr"] for group in self.param_groups]
        for group in self.param_groups:
            group["lr"] = group["lr"] * self.last_lr_scale
        try:
            return super().step(closure)
        finally:
            for group, lr in zip(self.param_groups, scheduled, strict=True):
                group["lr"] = lr


def add_policy_log_probs(data: DataProto, actor_output: DataProto) -> DataProto:
    """``data`` with the current policy's log-probs and ``sum_pi_squared`` from verl's actor log-prob pass
    ``actor_output`` (the ``DataProto`` ``RayPPOTrainer._compute_old_log_prob`` returns with
    ``actor.calculate_sum_pi_squared=True``; its ``old_log_probs`` are the policy's), stored as
    ``vcpo_policy_log_probs`` and ``sum_pi_squared``: ``old_log_probs`` stays as bypass mode set it, the rollout's,
    which the ``vcpo_*`` losses take as the behaviour policy. Bypass mode skips that pass, so a trainer in bypass
    mode runs it for OPOB and calls this before ``compute_opob_advantage``."""
    produced = actor_output.batch.keys()
    missing = [key for key in ("old_log_probs", "sum_pi_squared") if key not in produced]
    if missing:
        raise ValueError(f"actor_output has no {', '.join(missing)}: pass the actor's log-prob output, computed with "
                         f"actor.calculate_sum_pi_squared=True")
    data.batch[POLICY_LOG_PROBS] = actor_output.batch["old_log_probs"]
    data.batch["sum_pi_squared"] = actor_output.batch["sum_pi_squared"]
    return data


def compute_opob_advantage(data: DataProto, variant: str = "grad_only", weighting: str = "paper",
                           temperature: float = 1.0) -> DataProto:
    """``data`` with ``advantages`` and ``returns`` ([B, T], each row's OPOB advantage on its response tokens), for a
    trainer to call where verl's ``compute_advantage`` would run (verl passes a registered advantage estimator the
    rewards, mask and uid only: no log-probs, so none can form the logit proxy).

    Reads ``token_level_rewards`` (a row's reward is their sum), ``response_mask``, ``uid`` (the groups), the
    current policy's log-probs ``lp`` (``vcpo_policy_log_probs`` from ``add_policy_log_probs``, else
    ``old_log_probs``, which verl recomputes with the policy outside bypass mode) and ``sum_pi_squared``: G_i is the
    logit proxy ``sum_t (1 - 2 pi_t + sum_v pi_v^2) / T^2`` (``logit_proxy_grad_sq_norms``), and, for the variants
    that use W, ``logW_i = sum_t (lp - rollout_log_probs)`` when ``rollout_log_probs`` is there (0 otherwise).
    In bypass mode (``old_log_probs`` equal to ``rollout_log_probs``) without ``add_policy_log_probs`` it raises:
    W would be 1 and G the rollout's.
    """
    batch = data.batch
    keys = batch.keys()
    policy_key = POLICY_LOG_PROBS if POLICY_LOG_PROBS in keys else "old_log_probs"
    if policy_key == "old_log_probs" and "rollout_log_probs" in keys and torch.equal(batch["old_log_probs"],
                                                                                     batch["rollout_log_probs"]):
        raise ValueError("compute_opob_advantage: old_log_probs are the rollout's (verl's bypass mode), so W would be "
                         "1; run the actor's log-prob pass with actor.calculate_sum_pi_squared=True and "
                         "add_policy_log_probs(data, its output) first")
    if "sum_pi_squared" not in keys:
        raise ValueError("compute_opob_advantage needs sum_pi_squared: set actor.calculate_sum_pi_squared=True (in "
                         "bypass mode, add the actor's log-prob output with add_policy_log_probs)")
    mask_BT = batch["response_mask"].to(torch.float64)
    rewards_B = (batch["token_level_rewards"].double() * mask_BT).sum(dim=1)
    _, group_ids = np.unique(np.asarray(data.non_tensor_batch["uid"], dtype=str), return_inverse=True)
    group_ids_B = torch.as_tensor(group_ids, dtype=torch.long, device=mask_BT.device)
    policy_BT = batch[policy_key].double()
    # vcpo's proxy reads positions from 1 (position 0 has no logits in a full sequence): lead with a 0 column.
    pad = torch.nn.functional.pad
    G_B = logit_proxy_grad_sq_norms(pad(policy_BT, (1, 0)), pad(batch["sum_pi_squared"].double(), (1, 0)),
                                    pad(mask_BT, (1, 0)), temperature)
    logw_B = torch.zeros_like(rewards_B)
    if "rollout_log_probs" in keys:
        logw_B = sequence_log_weights(policy_BT, batch["rollout_log_probs"].double(), mask_BT)
    advantages_B = opob_advantages(rewards_B, logw_B, G_B, group_ids_B, weighting=weighting, variant=variant)
    advantages_BT = (advantages_B[:, None] * mask_BT).to(batch["token_level_rewards"].dtype)
    batch["advantages"], batch["returns"] = advantages_BT, advantages_BT.clone()
    return data


for _name in list_objectives():
    register_objective(_name)
