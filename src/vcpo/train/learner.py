"""The learner: one optimizer step per batch, blind to which objective it runs.

step(batch): recompute log pi on the batch -> sequence log-weights -> advantages (GRPO, Dr. GRPO,
RLOO, OPO or VCPO's OPOB) -> objective(name) -> backward -> clip -> AdamW step with the learning
rate scaled by the ESS ratio (VCPO §8.2: set lr, step, restore).

OPOB needs every trajectory's squared gradient norm G_i. With ``grad_norm_method="exact"`` they
come from one backward per row before the loss's own backward; ``"logit_proxy"`` replaces them by the
squared norm of the gradient with respect to the logits, read off the learner's own forward (no extra
backward; ``logit_proxy_grad_sq_norms``). With ``"fast"`` one batched
forward and backward yields G_i (ghost norms) and keeps what is needed to assemble
``sum_i c_i grad score_i`` for any per-row coefficients c_i; when the objective's gradient with
respect to the log-probs is one coefficient per row (REINFORCE-form sequence weights: vcpo, tis
and vespo with sequence advantages, reinforce), the final gradient is assembled from that single
backward (ALGORITHMS.md §8, efficient form). Otherwise a second backward of ``sum c_it lp_it``
supplies it. Either way G_i is computed only for the rows of groups whose rewards differ: a group of
equal rewards has advantage 0 whatever its G_i (``opob_rows_needing_grad_norms``).

With ``trainer.micro_batch_tokens`` the step runs as several forward/backward passes whose gradients sum to the
full-batch one (vcpo.train.micro_batches); the model's device and dtype are the config's, the optimizer's
precision policy is vcpo.train.precision's.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vcpo.config import Config, ConfigError
from vcpo.models.checkpointing import checkpointing_active, enable_activation_checkpointing
from vcpo.objectives import (
    ObjectiveInputs,
    ObjectiveOutput,
    get_objective,
    objective_hyperparameters,
    objective_scope,
)
from vcpo.train.micro_batches import WholeBatch, gather_rows, plan_micro_batches, trim_padding
from vcpo.train.mismatch import with_study_mismatch
from vcpo.train.precision import LearnerOptimizer
from vcpo.types import Batch
from vcpo.variance import (
    compute_advantages,
    ess_lr_scale,
    ess_ratio,
    logit_proxy_grad_sq_norms,
    opob_rows_needing_grad_norms,
    sequence_log_weights,
    token_logprobs,
    trajectory_grad_sq_norms,
)
from vcpo.variance.ghost_norms import PerRowGradCapture, gradient_lengths, lean_head, per_row_grad_capture
from vcpo.variance.logprobs import split_head


@dataclass
class _Part:
    """One micro-batch's detached results, its rows of the batch in the order of its tensors."""

    rows: Tensor
    batch: Batch
    lp_bS: Tensor
    entropy_bS: Tensor | None
    logw_b: Tensor
    adv_b: Tensor
    G_b: Tensor | None = None
    needed_b: Tensor | None = None
    out: ObjectiveOutput | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Learner:
    """Owns the trained model and its optimizer; ``version`` counts optimizer steps taken; ``lr`` is the learning rate
    before the ESS scale (trainer.lr, unless a health rollback lowered it)."""

    optimizer_class: type[LearnerOptimizer] = LearnerOptimizer

    def __init__(self, model: torch.nn.Module, config: Config) -> None:
        self.model = model
        self.config = config
        tc = config.trainer
        self.lr = tc.lr
        self.device = next(model.parameters()).device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = self.optimizer_class(self.params, lr=tc.lr, betas=tc.betas, weight_decay=tc.weight_decay)
        name = config.objective.name
        self.objective = get_objective(name)
        self.objective_kwargs = dict(config.objective.kwargs)
        if config.objective.loss_agg is not None:
            self.objective_kwargs["loss_agg"] = config.objective.loss_agg
        if config.objective.max_len is not None:
            self.objective_kwargs["max_len"] = config.objective.max_len
        self.loss_agg = self.objective_kwargs.get("loss_agg", objective_hyperparameters(name)["loss_agg"])
        self.scope = objective_scope(name)
        self.checkpointed = enable_activation_checkpointing(model) if tc.gradient_checkpointing else []
        # LoRA dropout acts in the gradient passes only: the model stays in eval mode, as the engine samples.
        self.dropouts = [m for name, m in model.named_modules()
                         if ".lora_dropout." in name and isinstance(m, torch.nn.Dropout) and m.p > 0]
        if config.model.lm_head_fp32 and split_head(model) is None:
            raise ConfigError(f"model.lm_head_fp32: {type(model).__name__}'s logits are not a Linear head of its "
                              "hidden states")
        self.version = 0
        self.skip_reason: str | None = None
        """Why the last step was skipped (e.g. "non-finite gradient"), None if it was taken."""
        self.update_lock = threading.Lock()
        """Held while a step changes the optimizer state and ``version`` (no collective inside): a reader holding it
        sees a state and the version it belongs to, also while another thread's step waits on a lost peer."""

    @property
    def single_backward(self) -> bool:
        """Whether OPOB's norms and the loss gradient come from one batched backward."""
        ac = self.config.advantage
        return ac.estimator == "opob" and ac.grad_norm_method == "fast"

    def logprobs(
        self, batch: Batch, grad: bool = True, entropy: bool = False, collision: bool = False
    ) -> Tensor | tuple[Tensor, ...]:
        """[B, S] log-probs of the response tokens at the rollout temperature (the lean path on large batches,
        activation checkpointing when configured and ``grad``); with ``entropy`` / ``collision`` as
        ``token_logprobs`` returns them.

        Right-padded, no position ids: the engine passes explicit positions to its left-padded rows,
        so both see the same positions and the log-probs agree (the mismatch test)."""
        with torch.set_grad_enabled(grad), checkpointing_active(self.checkpointed + self.dropouts if grad else []):
            return token_logprobs(
                self.model, batch.input_ids_BS, batch.attention_mask_BS, self.config.rollout.temperature,
                return_entropy=entropy, positions=batch.response_mask_BS, lm_head_fp32=self.config.model.lm_head_fp32,
                return_collision=collision,
            )

    def forward(
        self, batch: Batch, needed_B: Tensor | None = None, grad: bool = True
    ) -> tuple[Tensor, Tensor | None, PerRowGradCapture | None, Tensor | None]:
        """[B, S] log-probs, their entropy, the per-row capture (whose norms cover the rows ``needed_B``, all
        rows if None) and, for the logit proxy, the [B, S] collision probabilities. On the single-backward path
        the log-probs are a leaf: the loss's gradient reaches the model through the capture, not through autograd."""
        if self.single_backward:
            with checkpointing_active(self.dropouts if grad else []):
                _, capture = per_row_grad_capture(
                    self.model, batch.input_ids_BS, batch.response_mask_BS, batch.attention_mask_BS,
                    self.config.rollout.temperature, rows=needed_B, lm_head_fp32=self.config.model.lm_head_fp32,
                )
            return capture.logprobs_BT.detach().clone().requires_grad_(grad), None, capture, None
        if needed_B is not None and self.config.advantage.grad_norm_method == "logit_proxy":
            lp_BS, entropy_BS, collision_BS = self.logprobs(batch, grad=grad, entropy=True, collision=True)
            return lp_BS, entropy_BS, None, collision_BS
        lp_BS, entropy_BS = self.logprobs(batch, grad=grad, entropy=True)
        return lp_BS, entropy_BS, None, None

    def grad_sq_norms(
        self, batch: Batch, needed_B: Tensor, capture: PerRowGradCapture | None, lp_BS: Tensor,
        collision_BS: Tensor | None,
    ) -> tuple[Tensor, dict[str, float]]:
        """OPOB's G for the rows ``needed_B`` (0 elsewhere): from the capture, the forward's logits (the proxy), else
        by the configured method."""
        if capture is not None:
            return capture.sq_norms(needed_B), {}
        if collision_BS is not None:
            proxy_B = logit_proxy_grad_sq_norms(lp_BS, collision_BS, batch.response_mask_BS,
                                                self.config.rollout.temperature)
            return torch.where(needed_B, proxy_B, torch.zeros_like(proxy_B)), {}
        t0 = time.perf_counter()
        G_B = torch.zeros(needed_B.shape, dtype=torch.float64, device=needed_B.device)
        if bool(needed_B.any()):
            G_B[needed_B] = trajectory_grad_sq_norms(
                self.model, batch.input_ids_BS[needed_B], batch.response_mask_BS[needed_B],
                batch.attention_mask_BS[needed_B], method=self.config.advantage.grad_norm_method,
            ).to(G_B.dtype)
        return G_B, {"time/grad_norms_s": time.perf_counter() - t0}

    def part(
        self, batch: Batch, rows: Tensor, adv_B: Tensor | None, backward: bool, whole: WholeBatch | None = None
    ) -> _Part:
        """Log-probs, log-weights and advantages of one micro-batch (rows ``rows`` of the step's batch); with
        ``backward``, also the objective on it and the gradient of its loss, scaled to its share of the ``whole``
        batch's loss (unscaled without ``whole``), added to the gradients."""
        ac = self.config.advantage
        needed_B = None
        if ac.estimator == "opob":
            needed_B = opob_rows_needing_grad_norms(batch.rewards_B, batch.group_ids_B)
            # The fast norms read the rows that need them as views if they come first (order is immaterial:
            # every per-row quantity stays with its row and the loss and metrics are sums and quantiles); on the
            # chunked-head path, longest first within each, since the norms trim each chunk of rows to its longest.
            if self.single_backward:
                key_B = (~needed_B).to(torch.int64)
                mask_BS = batch.response_mask_BS
                if lean_head(self.model, mask_BS, self.config.model.lm_head_fp32) is not None:
                    S = mask_BS.shape[1]
                    key_B = key_B * (S + 1) + (S - gradient_lengths(mask_BS))
                if bool((key_B[1:] < key_B[:-1]).any()):
                    order = torch.argsort(key_B, stable=True)
                    batch, needed_B, rows = batch.rows(order), needed_B[order], rows[order]
        mask_BS = batch.response_mask_BS
        lp_BS, entropy_BS, capture, collision_BS = self.forward(batch, needed_B, grad=backward)
        logw_B = sequence_log_weights(lp_BS, batch.behavior_logprobs_BS, mask_BS)
        result = _Part(rows, batch, lp_BS.detach(), entropy_BS, logw_B.detach(), adv_B)
        if needed_B is not None:
            G_B, result.metrics = self.grad_sq_norms(batch, needed_B, capture, lp_BS, collision_BS)
            result.adv_b = compute_advantages("opob", batch.rewards_B, batch.group_ids_B, logw=logw_B,
                                              grad_sq_norms=G_B, weighting=ac.opob_weighting,
                                              variant=ac.opob_variant)
            result.G_b, result.needed_b = G_B, needed_B
        if not backward:
            return result
        result.out = self.objective(self.inputs(batch, lp_BS, result.adv_b), **self.objective_kwargs)
        loss = result.out.loss if whole is None else result.out.loss * whole.loss_scale(mask_BS)
        if capture is None:
            loss.backward()
        else:
            result.metrics["opob/second_backward"] = float(self.assemble_grad(loss, lp_BS, capture, batch))
        self.optimizer.accumulate()
        return result

    def inputs(self, batch: Batch, lp_BS: Tensor, adv_B: Tensor) -> ObjectiveInputs:
        return ObjectiveInputs(
            logprobs=lp_BS, behavior_logprobs=batch.behavior_logprobs_BS, advantages=adv_B,
            mask=batch.response_mask_BS, rewards=batch.rewards_B, group_ids=batch.group_ids_B,
        )

    def backward(self, batch: Batch) -> dict[str, float]:
        """Put grad_theta of the objective on ``batch`` into the gradients; returns the metrics so far."""
        # Eval mode: no dropout, so the recomputed log-probs are those of the policy that samples.
        self.model.eval()
        batch = batch.to(self.device)
        self.optimizer.zero_grad()
        ac = self.config.advantage
        keep_groups = ac.estimator == "opob" or self.scope != "row"
        plan = plan_micro_batches(batch.attention_mask_BS.sum(1), batch.group_ids_B,
                                  self.config.trainer.micro_batch_tokens, keep_groups)
        adv_B = None
        if ac.estimator != "opob":
            adv_B = compute_advantages(ac.estimator, batch.rewards_B, batch.group_ids_B,
                                       lengths=batch.response_mask_BS.sum(1))
        if len(plan) == 1:  # the single pass: the batch as it is
            part = self.part(batch, plan[0], adv_B, backward=True)
            return self.metrics(part.batch, [part], part.out)
        if self.scope == "batch":
            parts, out = self.two_pass(batch, plan, adv_B)
            return self.metrics(batch, parts, out)
        whole = WholeBatch.of(batch.response_mask_BS, self.loss_agg)
        parts = [self.part(trim_padding(batch.rows(rows)), rows, _rows_of(adv_B, rows), True, whole) for rows in plan]
        return self.metrics(batch, parts, None)

    def two_pass(self, batch: Batch, plan: list[Tensor], adv_B: Tensor | None) -> tuple[list[_Part], ObjectiveOutput]:
        """A batch-coupled objective over micro-batches: the objective once on the whole batch's detached log-probs
        gives ``coef = dL/dlp``; each micro-batch then backpropagates ``sum coef * lp`` (exact for any objective)."""
        parts = [self.part(trim_padding(batch.rows(rows)), rows, _rows_of(adv_B, rows), False) for rows in plan]
        return parts, self.coupled_backward(batch, parts)

    def coupled_backward(self, batch: Batch, parts: list[_Part]) -> ObjectiveOutput:
        """``two_pass``'s second pass over its forward-only ``parts``; returns the objective on the whole batch."""
        B, S = batch.input_ids_BS.shape
        lp_leaf_BS = self.gather_rows([(p.rows, p.lp_bS) for p in parts], B, S).requires_grad_()
        out = self.objective(self.inputs(batch, lp_leaf_BS, self.gather_rows([(p.rows, p.adv_b) for p in parts], B)),
                             **self.objective_kwargs)
        (coef_BS,) = torch.autograd.grad(out.loss, lp_leaf_BS)
        coef_BS = torch.where(batch.response_mask_BS.bool(), coef_BS, torch.zeros_like(coef_BS))
        for p in parts:
            lp_bS = self.logprobs(p.batch)
            (coef_BS[p.rows, : lp_bS.shape[1]] * lp_bS).sum().backward()
            self.optimizer.accumulate()
        if self.single_backward:  # the captures gave the norms only
            parts[0].metrics["opob/second_backward"] = 1.0
        return out

    def gather_rows(self, parts: list[tuple[Tensor, Tensor]], B: int, S: int | None = None) -> Tensor:
        """The whole batch's [B] (or [B, S]) tensor from the parts' rows: the seam where data-parallel ranks
        all-gather (vcpo.train.data_parallel)."""
        return gather_rows(parts, B, S)

    def metrics(self, batch: Batch, parts: list[_Part], out: ObjectiveOutput | None) -> dict[str, float]:
        """The step's metrics over the whole ``batch`` (whose rows the parts' ``rows`` index)."""
        B, S = batch.input_ids_BS.shape
        widths = {"lp_bS": S, "entropy_bS": S, "logw_b": None, "adv_b": None, "G_b": None, "needed_b": None}
        if len(parts) == 1:
            t = {name: getattr(parts[0], name) for name in widths}
        else:
            t = {name: None if getattr(parts[0], name) is None else
                 gather_rows([(p.rows, getattr(p, name)) for p in parts], B, width) for name, width in widths.items()}
        lp_BS, entropy_BS, logw_B, adv_B = t["lp_bS"], t["entropy_bS"], t["logw_b"], t["adv_b"]
        if out is None:  # the objective's diagnostics of the whole batch (no model involved)
            out = self.objective(self.inputs(batch, lp_BS, adv_B), **self.objective_kwargs)
        metrics = merge_part_metrics([p.metrics for p in parts])
        needed_B = t["needed_b"]
        if needed_B is not None:
            metrics["opob/grad_norm_rows_frac"] = float(needed_B.float().mean())
            if bool(needed_B.any()):  # G of the rows that have one
                metrics["opob/grad_sq_norm_mean"] = float(t["G_b"][needed_B].mean())
        mask_BS = batch.response_mask_BS
        nonempty_B = mask_BS.sum(1) > 0
        m = mask_BS.bool()
        metrics |= out.metrics
        metrics["ess/ratio"] = float(ess_ratio(logw_B[nonempty_B])) if bool(nonempty_B.any()) else 1.0
        metrics["adv/abs_mean"] = float(adv_B.abs().mean())
        if entropy_BS is not None and bool(m.any()):
            metrics["entropy/mean"] = float(entropy_BS[m].mean())
        current = m & (batch.versions_BS == self.version)  # sampled at the weights the learner has now
        if bool(current.any()):
            gap = (lp_BS - batch.behavior_logprobs_BS).abs()[current]
            metrics["mismatch/logprob_abs_max"] = float(gap.max())
            metrics["mismatch/logprob_abs_mean"] = float(gap.mean())
        return metrics

    def step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on ``batch``; returns the step's metrics (flat, namespaced).

        A step whose sampled log-probs, loss, ESS or gradient norm is not finite is skipped: no update,
        ``skipped_step`` = 1 and ``skip_reason`` says which (the trainer counts consecutive ones).
        """
        t0 = time.perf_counter()
        tc = self.config.trainer
        batch = with_study_mismatch(batch, self.config.rollout.study_mismatch_std, self.config.seed)  # off: as is
        if bool(torch.isfinite(batch.behavior_logprobs_BS[batch.response_mask_BS.bool()]).all()):
            metrics = self.backward(batch)
            grad_norm = self.optimizer.clip_grad_norm(tc.grad_clip)
            self.skip_reason = next((f"non-finite {name}" for name, value in (
                ("loss", metrics["loss/value"]), ("ESS", metrics["ess/ratio"]), ("gradient", grad_norm))
                if not math.isfinite(value)), None)
        else:  # the engine marks a row sampled from non-finite logits with a NaN log-prob: no gradient is sound
            metrics, grad_norm = {"ess/ratio": math.nan, "loss/value": math.nan}, math.nan
            self.skip_reason = "non-finite sampling log-prob"
        rho = metrics["ess/ratio"]
        finite = self.skip_reason is None
        scale = ess_lr_scale(rho, tc.ess_lr.reference, tc.ess_lr.rule) if tc.ess_lr.enabled and finite else 1.0
        with self.update_lock:
            for group in self.optimizer.param_groups:  # set lr, step, restore (Adam would undo a grad scale)
                group["lr"] = self.lr * scale
            if finite:
                self.optimizer.step()
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr
            self.optimizer.zero_grad()
            self.version += 1
        return metrics | {
            "grad_norm": grad_norm,
            "lr": self.lr * scale,
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
        if self.agreed(float(spread) <= 1e-6 * max(float(row_coef_B.abs().max()), 1e-30)):
            self.add_captured_grad(capture, row_coef_B)
            return False
        (coef_BS * self.logprobs(batch)).sum().backward()
        return True

    def agreed(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every learner rank (ranks whose passes are collectives must take the same ones)."""
        return flag

    def add_captured_grad(self, capture: PerRowGradCapture, coef_B: Tensor) -> None:
        """Add ``sum_b coef_b grad_theta score_b`` from the capture to the parameters' gradients."""
        capture.accumulate_grad(coef_B)


def merge_part_metrics(dicts: list[dict[str, float]]) -> dict[str, float]:
    """The parts' own metrics as the whole step's: times add up, anything else (opob/second_backward) is the max."""
    metrics: dict[str, float] = {}
    for d in dicts:
        for key, value in d.items():
            metrics[key] = metrics.get(key, 0.0) + value if key.startswith("time/") else max(metrics.get(key, value),
                                                                                            value)
    return metrics


def _rows_of(values_B: Tensor | None, rows: Tensor) -> Tensor | None:
    return None if values_B is None else values_B[rows]
