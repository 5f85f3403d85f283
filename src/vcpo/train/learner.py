"""The learner: one optimizer step per batch, blind to which objective it runs.

step(batch): recompute log pi on the batch -> sequence log-weights -> advantages (GRPO, Dr. GRPO,
RLOO, OPO or VCPO's OPOB) -> objective(name) -> backward -> clip -> AdamW step with the learning
rate scaled by the ESS ratio (VCPO §8.2: set lr, step, restore).

OPOB needs every trajectory's squared gradient norm G_i. With ``grad_norm_method="exact"`` they
come from one backward per row before the loss's own backward. With ``"fast"`` one batched
forward and backward yields G_i (ghost norms) and keeps what is needed to assemble
``sum_i c_i grad score_i`` for any per-row coefficients c_i; when the objective's gradient with
respect to the log-probs is one coefficient per row (REINFORCE-form sequence weights: vcpo, tis
and vespo with sequence advantages, reinforce), the final gradient is assembled from that single
backward (ALGORITHMS.md §8, efficient form). Otherwise a second backward of ``sum c_it lp_it``
supplies it. Either way G_i is computed only for the rows of groups whose rewards differ: a group of
equal rewards has advantage 0 whatever its G_i (``opob_rows_needing_grad_norms``).
"""

from __future__ import annotations

import math
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
    opob_rows_needing_grad_norms,
    sequence_log_weights,
    token_logprobs,
    trajectory_grad_sq_norms,
)
from vcpo.variance.ghost_norms import PerRowGradCapture, per_row_grad_capture


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
        if config.objective.max_len is not None:
            self.objective_kwargs["max_len"] = config.objective.max_len
        self.version = 0
        self.skip_reason: str | None = None
        """Why the last step was skipped (e.g. "non-finite gradient"), None if it was taken."""

    @property
    def single_backward(self) -> bool:
        """Whether OPOB's norms and the loss gradient come from one batched backward."""
        ac = self.config.advantage
        return ac.estimator == "opob" and ac.grad_norm_method == "fast"

    def forward(
        self, batch: Batch, needed_B: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None, PerRowGradCapture | None]:
        """[B, S] log-probs at the rollout temperature, their entropy, and the per-row capture (whose norms
        cover the rows ``needed_B``, all rows if None).

        Right-padded, no position ids: the engine passes explicit positions to its left-padded rows,
        so both see the same positions and the log-probs agree (the mismatch test). On the
        single-backward path the log-probs are a leaf: the loss's gradient reaches the model through
        the capture, not through autograd.
        """
        temperature = self.config.rollout.temperature
        if self.single_backward:
            _, capture = per_row_grad_capture(
                self.model, batch.input_ids_BS, batch.response_mask_BS, batch.attention_mask_BS, temperature,
                rows=needed_B,
            )
            return capture.logprobs_BT.detach().clone().requires_grad_(), None, capture
        lp_BS, entropy_BS = token_logprobs(
            self.model, batch.input_ids_BS, batch.attention_mask_BS, temperature=temperature, return_entropy=True
        )
        return lp_BS, entropy_BS, None

    def advantages(
        self, batch: Batch, logw_B: Tensor, capture: PerRowGradCapture | None = None, needed_B: Tensor | None = None
    ) -> tuple[Tensor, dict[str, float]]:
        """Per-sequence advantages by the configured estimator, with OPOB's inputs when it is chosen
        (norms for the rows ``needed_B``, by default ``opob_rows_needing_grad_norms``)."""
        ac = self.config.advantage
        lengths_B = batch.response_mask_BS.sum(1)
        if ac.estimator != "opob":
            adv = compute_advantages(ac.estimator, batch.rewards_B, batch.group_ids_B, lengths=lengths_B)
            return adv, {}
        metrics: dict[str, float] = {}
        if needed_B is None:
            needed_B = opob_rows_needing_grad_norms(batch.rewards_B, batch.group_ids_B)
        if capture is not None:  # computed by the forward's capture
            G_B = capture.sq_norms(needed_B)
        else:
            t0 = time.perf_counter()
            G_B = torch.zeros(needed_B.shape, dtype=torch.float64, device=needed_B.device)
            if bool(needed_B.any()):
                G_B[needed_B] = trajectory_grad_sq_norms(
                    self.model, batch.input_ids_BS[needed_B], batch.response_mask_BS[needed_B],
                    batch.attention_mask_BS[needed_B], method=ac.grad_norm_method,
                ).to(G_B.dtype)
            metrics["time/grad_norms_s"] = time.perf_counter() - t0
        adv = compute_advantages(
            "opob", batch.rewards_B, batch.group_ids_B, logw=logw_B, grad_sq_norms=G_B,
            weighting=ac.opob_weighting,
        )
        metrics["opob/grad_norm_rows_frac"] = float(needed_B.float().mean())
        if bool(needed_B.any()):  # G of the rows that have one
            metrics["opob/grad_sq_norm_mean"] = float(G_B[needed_B].mean())
        return adv, metrics

    def backward(self, batch: Batch) -> dict[str, float]:
        """Put grad_theta of the objective on ``batch`` into ``.grad``; returns the metrics so far."""
        # Eval mode: no dropout, so the recomputed log-probs are those of the policy that samples.
        self.model.eval()
        needed_B = None
        if self.config.advantage.estimator == "opob":
            needed_B = opob_rows_needing_grad_norms(batch.rewards_B, batch.group_ids_B)
            # The fast norms read the rows that need them as views if they come first (order is immaterial:
            # every per-row quantity stays with its row and the loss and metrics are sums and quantiles).
            if self.single_backward and bool((needed_B[1:] & ~needed_B[:-1]).any()):
                order = torch.argsort((~needed_B).to(torch.int8), stable=True)
                batch, needed_B = batch.rows(order), needed_B[order]
        mask_BS = batch.response_mask_BS
        lp_BS, entropy_BS, capture = self.forward(batch, needed_B)
        logw_B = sequence_log_weights(lp_BS, batch.behavior_logprobs_BS, mask_BS)
        adv_B, metrics = self.advantages(batch, logw_B, capture, needed_B)
        inputs = ObjectiveInputs(
            logprobs=lp_BS, behavior_logprobs=batch.behavior_logprobs_BS, advantages=adv_B, mask=mask_BS,
            rewards=batch.rewards_B, group_ids=batch.group_ids_B,
        )
        out = self.objective(inputs, **self.objective_kwargs)
        self.optimizer.zero_grad(set_to_none=True)
        if capture is None:
            out.loss.backward()
        else:
            metrics["opob/second_backward"] = float(self.assemble_grad(out.loss, lp_BS, capture, batch))
        nonempty_B = mask_BS.sum(1) > 0
        m = mask_BS.bool()
        metrics |= out.metrics
        metrics["ess/ratio"] = float(ess_ratio(logw_B[nonempty_B])) if bool(nonempty_B.any()) else 1.0
        metrics["adv/abs_mean"] = float(adv_B.abs().mean())
        if entropy_BS is not None and bool(m.any()):
            metrics["entropy/mean"] = float(entropy_BS[m].mean())
        return metrics

    def step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on ``batch``; returns the step's metrics (flat, namespaced).

        A step whose sampled log-probs, loss, ESS or gradient norm is not finite is skipped: no update,
        ``skipped_step`` = 1 and ``skip_reason`` says which (the trainer counts consecutive ones).
        """
        t0 = time.perf_counter()
        tc = self.config.trainer
        if bool(torch.isfinite(batch.behavior_logprobs_BS[batch.response_mask_BS.bool()]).all()):
            metrics = self.backward(batch)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, tc.grad_clip))
            self.skip_reason = next((f"non-finite {name}" for name, value in (
                ("loss", metrics["loss/value"]), ("ESS", metrics["ess/ratio"]), ("gradient", grad_norm))
                if not math.isfinite(value)), None)
        else:  # the engine marks a row sampled from non-finite logits with a NaN log-prob: no gradient is sound
            metrics, grad_norm = {"ess/ratio": math.nan, "loss/value": math.nan}, math.nan
            self.skip_reason = "non-finite sampling log-prob"
        rho = metrics["ess/ratio"]
        finite = self.skip_reason is None
        scale = ess_lr_scale(rho, tc.ess_lr.reference, tc.ess_lr.rule) if tc.ess_lr.enabled and finite else 1.0
        for group in self.optimizer.param_groups:  # set lr, step, restore (Adam would undo a grad scale)
            group["lr"] = tc.lr * scale
        if finite:
            self.optimizer.step()
        for group in self.optimizer.param_groups:
            group["lr"] = tc.lr
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return metrics | {
            "grad_norm": grad_norm,
            "lr": tc.lr * scale,
            "lr_scale": scale,
            "skipped_step": float(not finite),
            "time/learner_s": time.perf_counter() - t0,
        }

    def assemble_grad(self, loss: Tensor, lp_leaf_BS: Tensor, capture: PerRowGradCapture, batch: Batch) -> bool:
        """Write grad_theta(loss) into ``.grad`` from the capture; returns whether a second backward ran.

        ``coef = d loss / d lp`` is cheap (the objective is a function of the log-probs only). If it is
        one value per row on the counted tokens, ``grad_theta loss = sum_b c_b grad score_b`` and the
        capture assembles it; otherwise a second forward and backward of ``sum coef * lp`` does.
        """
        (coef_BS,) = torch.autograd.grad(loss, lp_leaf_BS)
        mask_BS = batch.response_mask_BS.bool()
        coef_BS = torch.where(mask_BS, coef_BS, torch.zeros_like(coef_BS))
        row_coef_B = coef_BS.sum(1) / mask_BS.sum(1).clamp(min=1)
        spread = torch.where(mask_BS, coef_BS - row_coef_B[:, None], torch.zeros_like(coef_BS)).abs().max()
        if float(spread) <= 1e-6 * max(float(row_coef_B.abs().max()), 1e-30):
            capture.accumulate_grad(row_coef_B)
            return False
        lp_BS = token_logprobs(self.model, batch.input_ids_BS, batch.attention_mask_BS,
                               temperature=self.config.rollout.temperature)
        (coef_BS * lp_BS).sum().backward()
        return True
