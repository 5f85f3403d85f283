"""``objective`` and ``advantage``: the loss and the baseline."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from vcpo.config.base import _Strict
from vcpo.config.recipe import DEFAULT_RECIPE, RECIPES
from vcpo.objective_specs import (
    objective_names,
)
from vcpo.plugins import PluginError, is_import_path

_DEFAULTS = RECIPES[DEFAULT_RECIPE]
"""The default recipe's values: the field defaults below (one source of truth with ``recipe``)."""

class ObjectiveConfig(_Strict):
    """The policy-gradient loss (docs/objectives.md)."""

    name: str = _DEFAULTS["objective.name"]
    """A registered objective (reinforce, ppo_clip (grpo), gspo, gspo_token, gmpo, sapo, cispo, tis, mis, icepop,
    m2po, vespo, bapo, topr, tb, vcpo), or ``module.sub:name``: your own objective function by import path
    (docs/extending.md). The default comes from ``recipe`` (``stable``: vespo; ``paper``: vcpo)."""
    loss_agg: str | None = None
    """How the per-token losses are averaged: token-mean, seq-mean-token-mean, seq-mean-token-sum or
    seq-mean-token-sum-norm (docs/objectives.md); None = the objective's own default."""
    max_len: int | None = Field(None, gt=0)
    """The constant length of ``loss_agg: seq-mean-token-sum-norm`` (Dr. GRPO), required by it, used by no other."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """The objective's own hyperparameters, typed and range-checked (strings such as "1e3" become numbers)."""

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v in objective_names():
            return v
        if not is_import_path(v):
            raise ValueError(f"unknown objective {v!r}; valid: {', '.join(objective_names())}, or an import path "
                             "module.sub:name")
        from vcpo.objectives.registry import resolve  # imports torch: only for a user's own objective

        try:
            resolve(v)
        except PluginError as e:
            raise ValueError(e.reason) from None
        return v


class AdvantageConfig(_Strict):
    """How each completion's advantage is computed from the rewards of its group (docs/variance.md)."""

    estimator: Literal["grpo", "dr_grpo", "rloo", "opo", "opob"] = _DEFAULTS["advantage.estimator"]
    """``grpo`` (R - mean) / std; ``dr_grpo`` R - mean; ``rloo`` leave-one-out mean; ``opo`` length-weighted
    baseline; ``opob`` VCPO's baseline weighted by importance weight squared times gradient norm squared."""
    opob_weighting: Literal["paper", "authors_code"] = "paper"
    """OPOB's weights: ``paper`` W^2 G; ``authors_code`` W^2 min(W, cap)^2 G, as the authors' released code."""
    opob_variant: Literal["plugin", "leave_one_out", "grad_only"] = _DEFAULTS["advantage.opob_variant"]
    """OPOB's baseline (docs/variance.md; the default comes from ``recipe``: ``stable`` grad_only, ``paper``
    plugin): ``plugin``, the paper's group baseline b_g; ``leave_one_out``, each row's
    baseline over the other rows of its group; ``grad_only``, weights G without W^2. Any variant, either weighting."""
    grad_norm_method: Literal["exact", "fast", "logit_proxy"] = _DEFAULTS["advantage.grad_norm_method"]
    """How OPOB gets per-trajectory gradient norms (the default comes from ``recipe``: ``stable`` logit_proxy,
    ``paper`` fast): "fast" (one batched backward, ghost norms), "exact" (one
    backward per row, the reference) or "logit_proxy" (the squared norm of the gradient with respect to the logits
    only, from the learner's own forward: no extra backward; a proxy that ranks rows, not G itself)."""


