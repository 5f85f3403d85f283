"""The learner: one optimizer step per batch, blind to which objective it runs.

step(batch): recompute log pi on the batch -> sequence log-weights -> advantages (GRPO, Dr. GRPO,
RLOO, OPO or VCPO's OPOB) -> objective(name) -> backward -> clip -> AdamW step with the learning
rate scaled by the ESS ratio (VCPO §8.2: set lr, step, restore).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from vcpo.config import Config
from vcpo.objectives import ObjectiveInputs, get_objective
from vcpo.types import Batch
from vcpo.variance import (
    compute_advantages,
    ess_lr_scale,
    ess_ratio,
    sequence_log_weights,
    token_logprobs,
    trajectory_grad_sq_norms,
)


class Learner:
    """Owns the trained model and its optimizer; ``version`` counts optimizer steps taken."""

    def __init__(self, model: torch.nn.Module, config: Config) -> None:
        self.model = model
        self.config = config
        tc = config.trainer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=tc.lr, betas=tc.betas, weight_decay=tc.weight_decay)
        self.objective = get_objective(config.objective.name)
        self.objective_kwargs = dict(config.objective.kwargs)
        if config.objective.loss_agg is not None:
            self.objective_kwargs["loss_agg"] = config.objective.loss_agg
        self.version = 0

    def advantages(self, batch: Batch, logw_B: Tensor) -> tuple[Tensor, dict[str, float]]:
        """Per-sequence advantages by the configured estimator, with OPOB's inputs when it is chosen."""
        ac = self.config.advantage
        lengths_B = batch.response_mask_BS.sum(1)
        if ac.estimator != "opob":
            adv = compute_advantages(ac.estimator, batch.rewards_B, batch.group_ids_B, lengths=lengths_B)
            return adv, {}
        t0 = time.perf_counter()
        G_B = trajectory_grad_sq_norms(
            self.model, batch.input_ids_BS, batch.response_mask_BS, batch.attention_mask_BS,
            method=ac.grad_norm_method,
        )
        adv = compute_advantages(
            "opob", batch.rewards_B, batch.group_ids_B, logw=logw_B, grad_sq_norms=G_B,
            weighting=ac.opob_weighting,
        )
        return adv, {"opob/grad_sq_norm_mean": float(G_B.mean()), "time/grad_norms_s": time.perf_counter() - t0}

    def step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on ``batch``; returns the step's metrics (flat, namespaced)."""
        t0 = time.perf_counter()
        tc = self.config.trainer
        # Eval mode: no dropout, so the recomputed log-probs are those of the policy that samples.
        self.model.eval()
        mask_BS = batch.response_mask_BS
        # Right-padded, no position ids: the engine passes explicit positions to its left-padded
        # rows, so both see the same positions and the log-probs agree (the mismatch test).
        lp_BS, entropy_BS = token_logprobs(
            self.model, batch.input_ids_BS, batch.attention_mask_BS,
            temperature=self.config.rollout.temperature, return_entropy=True,
        )
        logw_B = sequence_log_weights(lp_BS, batch.behavior_logprobs_BS, mask_BS)
        adv_B, metrics = self.advantages(batch, logw_B)
        inputs = ObjectiveInputs(
            logprobs=lp_BS, behavior_logprobs=batch.behavior_logprobs_BS, advantages=adv_B, mask=mask_BS,
            rewards=batch.rewards_B, group_ids=batch.group_ids_B,
        )
        out = self.objective(inputs, **self.objective_kwargs)
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, tc.grad_clip))

        nonempty_B = mask_BS.sum(1) > 0
        rho = float(ess_ratio(logw_B[nonempty_B])) if bool(nonempty_B.any()) else 1.0
        scale = ess_lr_scale(rho, tc.ess_lr.reference, tc.ess_lr.rule) if tc.ess_lr.enabled else 1.0
        lr = tc.lr * scale
        for group in self.optimizer.param_groups:  # set lr, step, restore (Adam would undo a grad scale)
            group["lr"] = lr
        if torch.isfinite(torch.tensor(grad_norm)):
            self.optimizer.step()
        for group in self.optimizer.param_groups:
            group["lr"] = tc.lr
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

        m = mask_BS.bool()
        metrics |= out.metrics
        metrics |= {
            "ess/ratio": rho,
            "grad_norm": grad_norm,
            "lr": lr,
            "lr_scale": scale,
            "entropy/mean": float(entropy_BS[m].mean()) if bool(m.any()) else 0.0,
            "adv/abs_mean": float(adv_B.abs().mean()),
            "skipped_step": float(not torch.isfinite(torch.tensor(grad_norm))),
            "time/learner_s": time.perf_counter() - t0,
        }
        return metrics
