"""Variance control for off-policy policy gradients: importance weights, ESS, the ESS-scaled
learning rate and the off-policy optimal baseline (VCPO, arXiv 2602.17616)."""

from vcpo.variance.ess import ess, ess_lr_scale, ess_ratio, sequence_log_weights

__all__ = ["ess", "ess_lr_scale", "ess_ratio", "sequence_log_weights"]
