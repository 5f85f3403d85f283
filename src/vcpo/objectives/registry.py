"""The objective registry: names to pure loss functions, with argument checking and diagnostics.

Adding an objective is one new module with one ``@register("name")`` function.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

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
    ``scope`` of the statistics its per-row loss depends on (one of ``SCOPES``)."""
    if scope not in SCOPES:
        raise ValueError(f"objective {name!r}: scope {scope!r} is not one of {', '.join(SCOPES)}")

    def deco(fn: ObjectiveFn) -> ObjectiveFn:
        for key in (name, *aliases):
            if key in _REGISTRY:
                raise ValueError(f"objective {key!r} is already registered")
            _REGISTRY[key] = fn
            _SCOPES[key] = scope
        return fn

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
    """The objective called ``name``, wrapped to reject unknown hyperparameters by name and to
    add the shared behavior diagnostics (ratio tails, KL, ESS) to its metrics."""
    fn = _lookup(name)
    allowed = objective_hyperparameters(name)

    @functools.wraps(fn)
    def objective(inputs: ObjectiveInputs, **hyperparameters: object) -> ObjectiveOutput:
        if not isinstance(inputs, ObjectiveInputs):
            raise TypeError(f"objective {name!r} takes an ObjectiveInputs, got {type(inputs).__name__}")
        unknown = sorted(set(hyperparameters) - set(allowed))
        if unknown:
            raise ValueError(
                f"unknown hyperparameter(s) {', '.join(map(repr, unknown))} for objective {name!r}; "
                f"valid: {', '.join(sorted(allowed))}"
            )
        out = fn(inputs, **hyperparameters)
        metrics = behavior_metrics(inputs) | out.metrics
        metrics["loss/value"] = float(out.loss.detach())
        return ObjectiveOutput(loss=out.loss, metrics=metrics)

    return objective


def check_range(name: str, value: float, low: float | None = None, high: float | None = None,
                low_open: bool = False) -> None:
    """Raise ``ValueError`` naming a hyperparameter outside [low, high] (or (low, high])."""
    bad = value is None or value != value  # None or NaN
    if not bad and low is not None:
        bad = value <= low if low_open else value < low
    if not bad and high is not None:
        bad = value > high
    if bad:
        lo = "(" if low_open else "["
        raise ValueError(f"hyperparameter {name}={value!r} is out of range {lo}{low}, {high}]")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming a hyperparameter whose value is not one of ``choices``."""
    if value not in choices:
        raise ValueError(f"hyperparameter {name}={value!r} must be one of {', '.join(map(repr, choices))}")
