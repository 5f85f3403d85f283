"""Variance control for off-policy policy gradients: importance weights, ESS, the ESS-scaled
learning rate, the off-policy optimal baseline and group advantage estimators (VCPO, arXiv 2602.17616)."""

from vcpo.variance.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    dr_grpo_advantages,
    grpo_advantages,
    opo_advantages,
    rloo_advantages,
)
from vcpo.variance.baselines import (
    OPOB_VARIANTS,
    OPOB_WEIGHTINGS,
    opob_advantages,
    opob_baseline,
    opob_rows_needing_grad_norms,
)
from vcpo.variance.ess import ess, ess_lr_scale, ess_ratio, sequence_log_weights
from vcpo.variance.grad_norms import GRAD_SQ_NORM_METHODS, logit_proxy_grad_sq_norms, trajectory_grad_sq_norms
from vcpo.variance.logprobs import token_logprobs

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "GRAD_SQ_NORM_METHODS",
    "OPOB_VARIANTS",
    "OPOB_WEIGHTINGS",
    "compute_advantages",
    "dr_grpo_advantages",
    "ess",
    "ess_lr_scale",
    "ess_ratio",
    "grpo_advantages",
    "logit_proxy_grad_sq_norms",
    "opo_advantages",
    "opob_advantages",
    "opob_baseline",
    "opob_rows_needing_grad_norms",
    "rloo_advantages",
    "sequence_log_weights",
    "token_logprobs",
    "trajectory_grad_sq_norms",
]
