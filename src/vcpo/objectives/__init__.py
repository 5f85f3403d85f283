"""Off-policy policy-gradient objectives as pure functions of per-token tensors.

``get_objective(name)(ObjectiveInputs(...), loss_agg=..., **hyperparameters)`` returns an
``ObjectiveOutput(loss, metrics)``. Each objective lives in its own module of this package and
registers itself with ``@register("name")``; every module here is imported once, below.
"""

import importlib
import pkgutil

from vcpo.objectives.aggregation import LOSS_AGG_MODES, aggregate, normaliser_count
from vcpo.objectives.registry import (
    SCOPES,
    get_objective,
    list_objectives,
    objective_hyperparameters,
    objective_scope,
    register,
)
from vcpo.objectives.types import ObjectiveInputs, ObjectiveOutput

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "LOSS_AGG_MODES",
    "SCOPES",
    "ObjectiveInputs",
    "ObjectiveOutput",
    "aggregate",
    "get_objective",
    "list_objectives",
    "normaliser_count",
    "objective_hyperparameters",
    "objective_scope",
    "register",
]
