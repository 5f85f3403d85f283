"""The objective registry: names to pure loss functions, with argument checking and diagnostics.

Adding an objective to vcpo is one new module with one ``@register("name")`` function and its hyperparameters'
spec in ``vcpo.objective_specs`` (types, ranges, defaults), which every call is checked against. A user's own
objective registers from its own module (its spec from its signature, or ``params``) and is named in the config
by import path (``objective.name: mypkg.losses:my_loss``, docs/extending.md).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping

import torch

from vcpo.objective_specs import (
    ALIASES,
    BUILTIN_OBJECTIVES,
    LOSS_AGG_MODES,
    OBJECTIVES,
    Param,
    add_alias,
    add_objective,
    aggregation_params,
    check_hyperparameters,
)
from vcpo.objectives.diagnostics import behavior_metrics
from vcpo.objectives.types import ObjectiveInputs, ObjectiveOutput
from vcpo.plugins import is_import_path, load_object

ObjectiveFn = Callable[..., ObjectiveOutput]
_REGISTRY: dict[str, ObjectiveFn] = {}
_SCOPES: dict[str, str] = {}

SCOPES = ("row", "group", "batch")
"""What a row's loss depends on besides its own tensors (and the batch's token or sequence count that the
aggregation divides by): nothing ("row"), its GRPO group's rows ("group", e.g. TB's per-group logZ), or every row
of the call ("batch", e.g. BAPO's bounds, M2PO's mask). Micro-batched learners read it (docs/objectives.md)."""


def register(name: str, *aliases: str, scope: str = "row", params: Mapping[str, Param] | None = None
             ) -> Callable[[ObjectiveFn], ObjectiveFn]:
    """Register ``fn(inputs, *, loss_agg, max_len, **hyperparameters)`` under ``name`` (and aliases), with the
    ``scope`` of the statistics its per-row loss depends on (one of ``SCOPES``).

    The registered function checks and coerces its keyword arguments against the objective's spec before it
    runs, so a bad value is one ``ValueError`` naming it. vcpo's own objectives find their spec in
    ``vcpo.objective_specs``. A user's objective (any other name) takes it from its signature: each keyword-only
    hyperparameter is typed by its default (a float, int or str), unless ``params`` gives its ``Param`` (a range,
    choices, None allowed); ``loss_agg`` must default to one of the four modes and ``max_len`` to None.
    """
    if scope not in SCOPES:
        raise ValueError(f"objective {name!r}: scope {scope!r} is not one of {', '.join(SCOPES)}")
    builtin = name in BUILTIN_OBJECTIVES
    if builtin and (name not in OBJECTIVES or params is not None
                    or sorted(aliases) != sorted(a for a, target in ALIASES.items() if target == name)):
        raise ValueError(f"objective {name!r} (aliases {aliases}) does not match vcpo.objective_specs")

    def deco(fn: ObjectiveFn) -> ObjectiveFn:
        for key in (name, *aliases):
            if key in _REGISTRY:
                raise ValueError(f"objective {key!r} is already registered")
        if not builtin:
            add_objective(name, signature_spec(name, fn, params or {}), aliases)

        @functools.wraps(fn)
        def checked(inputs: ObjectiveInputs, **hyperparameters: object) -> ObjectiveOutput:
            return fn(inputs, **check_hyperparameters(name, hyperparameters))

        checked.registered_name = name  # what an import path of this function resolves to
        for key in (name, *aliases):
            _REGISTRY[key] = checked
            _SCOPES[key] = scope
        return checked

    return deco


def signature_spec(name: str, fn: Callable, params: Mapping[str, Param]) -> dict[str, Param]:
    """The hyperparameter spec of a user's objective ``fn``: ``loss_agg`` and ``max_len``, then each other
    keyword-only parameter as ``params`` gives it or as its default's type says. ValueError says what is amiss."""
    sig = inspect.signature(fn)
    kinds = [p.kind for p in sig.parameters.values()]
    keyword = {p.name: p for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}

    def amiss(why: str) -> ValueError:
        return ValueError(f"objective {name!r}: {why} (its signature is {sig})")

    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if sum(k in positional for k in kinds) != 1 or kinds[0] not in positional or inspect.Parameter.VAR_KEYWORD in kinds:
        raise amiss("it must take one positional argument, the ObjectiveInputs, then keyword-only hyperparameters")
    loss_agg, max_len = keyword.get("loss_agg"), keyword.get("max_len")
    if loss_agg is None or loss_agg.default not in LOSS_AGG_MODES or max_len is None or max_len.default is not None:
        raise amiss(f"it needs the keyword-only hyperparameters loss_agg (defaulting to one of "
                    f"{', '.join(LOSS_AGG_MODES)}) and max_len=None; vcpo.objectives.aggregate applies them")
    spec = aggregation_params(loss_agg.default)
    for key in params:
        if key not in keyword or key in spec:
            raise amiss(f"params names {key!r}, which is not one of its own keyword-only hyperparameters")
    for key, p in keyword.items():
        if key in spec:
            continue
        if key in params:
            if params[key].default != p.default:
                raise amiss(f"params[{key!r}] has default {params[key].default!r}, the signature {p.default!r}")
            spec[key] = params[key]
        elif type(p.default) in (float, int, str):
            spec[key] = Param(type(p.default), p.default)
        else:
            raise amiss(f"hyperparameter {key!r} defaults to {p.default!r}: give it a float, int or str default, "
                        f"or its Param in params")
    return spec


def resolve(path: str) -> str:
    """The registered name of the objective at import path ``path`` (``module.sub:name``), importing its module
    on first use: the name its ``@register`` gave it, or ``path`` itself for a plain function, which is then
    registered with the spec of its signature and scope "row". ``PluginError`` / ``ValueError`` say what is
    wrong, in one line."""
    if path in _REGISTRY:
        return getattr(_REGISTRY[path], "registered_name", path)
    fn = load_object(path)
    name = getattr(fn, "registered_name", None)
    if name is not None and _REGISTRY.get(name) is fn:
        add_alias(path, name)
        _REGISTRY[path], _SCOPES[path] = fn, _SCOPES[name]
        return name
    if not callable(fn) or isinstance(fn, type):
        raise ValueError(f"objective {path!r} is {type(fn).__name__} {fn!r}, not a function")
    register(path)(fn)
    return path


def check_objective(name: str, **hyperparameters: object) -> None:
    """Run objective ``name`` once on a small random batch: ValueError unless it returns an ``ObjectiveOutput``
    whose loss is a finite scalar with a gradient (how the config checks a user's objective when it loads)."""
    rng = torch.Generator().manual_seed(0)
    lp = (torch.randn(4, 3, generator=rng) * 0.1 - 1.0).requires_grad_()
    inputs = ObjectiveInputs(logprobs=lp, behavior_logprobs=lp.detach() + 0.1, advantages=torch.randn(4, generator=rng),
                             mask=torch.ones(4, 3), rewards=torch.rand(4, generator=rng),
                             group_ids=torch.tensor([0, 0, 1, 1]), ref_logprobs=lp.detach().clone())
    try:
        out = get_objective(name)(inputs, **hyperparameters)
        loss = out.loss
        ok = isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad and bool(torch.isfinite(loss))
    except Exception as exc:
        raise ValueError(f"objective {name!r} raised on a test batch: {type(exc).__name__}: {exc}") from None
    if not ok:
        raise ValueError(f"objective {name!r} must return a finite scalar loss that carries a gradient, got "
                         f"{loss!r}")


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
    if name not in _REGISTRY and is_import_path(name):
        resolve(name)
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
        if not isinstance(out, ObjectiveOutput):
            raise TypeError(f"objective {name!r} returned {type(out).__name__}, not an ObjectiveOutput")
        metrics = behavior_metrics(inputs) | out.metrics
        metrics["loss/value"] = float(out.loss.detach())
        return ObjectiveOutput(loss=out.loss, metrics=metrics)

    return objective
