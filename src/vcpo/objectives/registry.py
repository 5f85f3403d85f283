"""The objective registry: names to pure loss functions, with argument checking and diagnostics.

Adding an objective is one new module with one ``@register("name")`` function and its hyperparameters'
spec in ``vcpo.objective_specs`` (types, ranges, defaults), which every call is checked against.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from vcpo.objective_specs import ALIASES, OBJECTIVES, check_hyperparameters
from vcpo.objectives.diagnostics import behavior_metrics
from vcpo.objectives.types import ObjectiveInputs, ObjectiveOutput

ObjectiveFn = Callable[..., ObjectiveOutput]
_REGISTRY: dict[str, ObjectiveFn] = {}
_SCOPES: dict[str, str] = {}

SCOPES = ("row", "group", "batch")
"""What a row's loss depends on besides its own tensors (and the batch's token or sequence count that the
aggregation divides by): nothing ("row"), its GRPO group's rows ("group", e.g. TB's per-group logZ), or every row
of the call ("batch", e.g. BAPO's bounds, M2PO's mask). Micro-batched learners read it (docs/objectives.md)."""


def register(name: str, *aliases: str, scope: str = "row") -> Callable[[ObjectiveFn], ObjectiveFn]:
    """Register ``fn(inputs, *, loss_agg, max_len, **hyperparameters)`` under ``name`` (and aliases), with the
    ``scope`` of the statistics its per-row loss depends on (one of ``SCOPES``).

    The registered function checks and coerces its keyword arguments against the objective's spec
    (``vcpo.objective_specs``) before it runs, so a bad value is one ``ValueError`` naming it.
    """
    if scope not in SCOPES:
        raise ValueError(f"objective {name!r}: scope {scope!r} is not one of {', '.join(SCOPES)}")
    if name not in OBJECTIVES or sorted(aliases) != sorted(a for a, target in ALIASES.items() if target == name):
        raise ValueError(f"objective {name!r} (aliases {aliases}) does not match vcpo.objective_specs")

    def deco(fn: ObjectiveFn) -> ObjectiveFn:
        @functools.wraps(fn)
        def checked(inputs: ObjectiveInputs, **hyperparameters: object) -> ObjectiveOutput:
            return fn(inputs, **check_hyperparameters(name, hyperparameters))

        for key in (name, *aliases):
            if key in _REGISTRY:
                raise ValueError(f"objective {key!r} is already registered")
            _REGISTRY[key] = checked
            _SCOPES[key] = scope
        return checked

    return deco


def objective_scope(name: str) -> str:
    """The scope (``SCOPES``) of the statistics that ``name``'s per-row loss depends on."""
    _lookup(name)
    return _SCOPES[name]


def list_objectives() -> list[str]:
    """Sorted registered names, aliases included."""
    return sorted(_REGISTRY)


def objective_hyperparameters(name: str) -> dict[str, object]:
    """The keyword hyperparameters of an objective and their defaults (``loss_agg`` included)."""
    fn = _lookup(name)
    return {
        p.name: p.default
        for p in inspect.signature(fn).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def _lookup(name: str) -> ObjectiveFn:
    if name not in _REGISTRY:
        raise ValueError(f"unknown objective {name!r}; valid names: {', '.join(list_objectives())}")
    return _REGISTRY[name]


def get_objective(name: str) -> Callable[..., ObjectiveOutput]:
    """The objective called ``name``, wrapped to add the shared behavior diagnostics (ratio tails, KL,
    ESS) to its metrics; unknown or bad hyperparameters raise ``ValueError`` naming them."""
    fn = _lookup(name)

    @functools.wraps(fn)
    def objective(inputs: ObjectiveInputs, **hyperparameters: object) -> ObjectiveOutput:
        if not isinstance(inputs, ObjectiveInputs):
            raise TypeError(f"objective {name!r} takes an ObjectiveInputs, got {type(inputs).__name__}")
        out = fn(inputs, **hyperparameters)
        metrics = behavior_metrics(inputs) | out.metrics
        metrics["loss/value"] = float(out.loss.detach())
        return ObjectiveOutput(loss=out.loss, metrics=metrics)

    return objective
