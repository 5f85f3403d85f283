"""Off-policy policy-gradient objectives as pure functions of per-token tensors.

``get_objective(name)(ObjectiveInputs(...), loss_agg=..., **hyperparameters)`` returns an
``ObjectiveOutput(loss, metrics)``. Each objective lives in its own module and registers itself.
"""

from vcpo.objectives import (  # noqa: F401  (imported for their registrations)
    ppo_clip,
    reinforce,
)
from vcpo.objectives.aggregation import LOSS_AGG_MODES, aggregate
from vcpo.objectives.registry import get_objective, list_objectives, objective_hyperparameters, register
from vcpo.objectives.types import ObjectiveInputs, ObjectiveOutput

__all__ = [
    "LOSS_AGG_MODES",
    "ObjectiveInputs",
    "ObjectiveOutput",
    "aggregate",
    "get_objective",
    "list_objectives",
    "objective_hyperparameters",
    "register",
]
