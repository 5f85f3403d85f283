"""What each objective accepts: the type, range or choices, and default of every hyperparameter.

Torch-free, so that the config checks ``objective.*`` when it loads, before any heavy import; the
registry checks every call against the same specs, and a test holds them equal to the signatures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
"""ALGORITHMS.md §1; the last one (Dr. GRPO) divides by a constant ``max_len`` and needs it."""
SUM_NORM = "seq-mean-token-sum-norm"


@dataclass(frozen=True)
class Param:
    """One keyword hyperparameter. A bound is a number or the name of another hyperparameter of the
    same objective (e.g. BAPO's ``c_low_max >= c_low``); ``optional`` accepts None."""

    kind: type
    default: Any
    low: float | str | None = None
    high: float | str | None = None
    low_open: bool = False
    choices: tuple[str, ...] = ()
    optional: bool = False


class HyperparameterError(ValueError):
    """A bad hyperparameter; ``name`` is the culprit and ``reason`` says what is wrong with it."""

    def __init__(self, objective: str, name: str, reason: str) -> None:
        super().__init__(f"hyperparameter {name!r} of objective {objective!r}: {reason}")
        self.objective, self.name, self.reason = objective, name, reason


def aggregation_params(default: str) -> dict[str, Param]:
    """``loss_agg`` (default ``default``) and ``max_len``: the two hyperparameters every objective takes."""
    return {"loss_agg": Param(str, default, choices=LOSS_AGG_MODES),
            "max_len": Param(int, None, low=0, low_open=True, optional=True)}


_agg = aggregation_params  # the table below names it often


def _ratio_clip(eps_low: float, eps_high: float, eps_low_max: float | None = 1.0) -> dict[str, Param]:
    return {"eps_low": Param(float, eps_low, low=0.0, high=eps_low_max), "eps_high": Param(float, eps_high, low=0.0)}


_DUAL_CLIP = Param(float, None, low=1.0, low_open=True, optional=True)
_POSITIVE = {"low": 0.0, "low_open": True}

OBJECTIVES: dict[str, dict[str, Param]] = {
    "reinforce": _agg("token-mean"),
    "ppo_clip": _agg("token-mean") | _ratio_clip(0.2, 0.2) | {"dual_clip": _DUAL_CLIP},
    "gspo": _agg("seq-mean-token-mean") | _ratio_clip(3e-4, 4e-4),
    "gspo_token": _agg("seq-mean-token-mean") | _ratio_clip(3e-4, 4e-4),
    "gmpo": _agg("seq-mean-token-mean") | _ratio_clip(0.4, 0.4, eps_low_max=None),
    "sapo": _agg("seq-mean-token-mean") | {"tau_pos": Param(float, 1.0, **_POSITIVE),
                                           "tau_neg": Param(float, 1.05, **_POSITIVE)},
    "cispo": _agg("token-mean") | _ratio_clip(1.0, 3.0),
    "tis": _agg("token-mean") | {"level": Param(str, "token", choices=("token", "sequence")),
                                 "cap": Param(float, 2.0, low=1.0)},
    "mis": _agg("token-mean") | {"level": Param(str, "token", choices=("token", "sequence", "geometric")),
                                 "low": Param(float, None, low=0.0, high=1.0, optional=True),
                                 "high": Param(float, None, low=1.0, optional=True),
                                 "weight": Param(str, "ratio", choices=("ratio", "unit"))},
    "icepop": _agg("seq-mean-token-mean") | {"low": Param(float, 0.5, low=0.0, high=1.0),
                                             "high": Param(float, 5.0, low=1.0)}
    | _ratio_clip(0.2, 0.2) | {"dual_clip": _DUAL_CLIP},
    "m2po": _agg("token-mean") | {"tau": Param(float, 0.04, **_POSITIVE),
                                  "behavior_weight_max": Param(float, None, low=1.0, optional=True)},
    "vespo": _agg("token-mean") | {"k_pos": Param(float, 2.0, low=0.0), "lambda_pos": Param(float, 3.0, **_POSITIVE),
                                   "k_neg": Param(float, 3.0, low=0.0), "lambda_neg": Param(float, 2.0, **_POSITIVE)},
    "bapo": _agg("token-mean") | {
        "target": Param(float, 1.0, **_POSITIVE),
        "c_low": Param(float, 0.6, low=0.0, high=1.0, low_open=True),
        "c_low_max": Param(float, 0.8, low="c_low", high=1.0),
        "c_high": Param(float, 1.2, low=1.0),
        "c_high_max": Param(float, 2.0, low="c_high"),
        "step": Param(float, None, **_POSITIVE, optional=True),
        "step_low": Param(float, None, **_POSITIVE, optional=True),
        "step_high": Param(float, None, **_POSITIVE, optional=True),
        "dual_clip": Param(float, 3.0, low=1.0, low_open=True, optional=True),
    },
    "topr": _agg("seq-mean-token-sum") | {"level": Param(str, "sequence", choices=("sequence", "token"))},
    "tb": _agg("seq-mean-token-mean") | {"beta": Param(float, 0.012, **_POSITIVE)},
    "vcpo": _agg("seq-mean-token-mean") | {"cap": Param(float, 8.0, **_POSITIVE)},
}
ALIASES = {"grpo": "ppo_clip"}
BUILTIN_OBJECTIVES = frozenset([*OBJECTIVES, *ALIASES])
"""vcpo's own names; ``add_objective`` adds a user's objective (and its import path, as an alias) beside them."""
EXCLUSIVE = {"bapo": [("step", ("step_low", "step_high"))]}
"""A shortcut that sets other hyperparameters (BAPO's ``step`` sets both bounds' steps), given with any of them."""


def add_objective(name: str, spec: dict[str, Param], aliases: tuple[str, ...] = ()) -> None:
    """Make a user's objective known to the checks here (``vcpo.objectives.register`` calls it)."""
    for key in (name, *aliases):
        if key in OBJECTIVES or key in ALIASES:
            raise ValueError(f"objective {key!r} is already registered")
    OBJECTIVES[name] = spec
    ALIASES.update(dict.fromkeys(aliases, name))


def add_alias(alias: str, name: str) -> None:
    """Let ``alias`` (an import path) name the registered objective ``name``."""
    if ALIASES.get(alias, name) != name or alias in OBJECTIVES:
        raise ValueError(f"objective {alias!r} is already registered")
    ALIASES[alias] = name


def objective_names() -> list[str]:
    """Every objective name the registry answers to, aliases included, sorted."""
    return sorted([*OBJECTIVES, *ALIASES])


def spec_of(objective: str) -> dict[str, Param]:
    """The hyperparameters of ``objective`` (an alias gives its target's); ValueError lists the valid names."""
    name = ALIASES.get(objective, objective)
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; valid names: {', '.join(objective_names())}")
    return OBJECTIVES[name]


def _coerce(kind: type, value: Any) -> Any:
    """``value`` as ``kind``; strings are parsed (YAML 1.1 reads ``1e3`` as a string). ValueError if it is not one."""
    if isinstance(value, bool):  # a bool is an int to Python, never a number to a user
        raise ValueError
    if kind is str:
        if not isinstance(value, str):
            raise ValueError
        return value
    if isinstance(value, str):
        value = float(value.strip())
    if not isinstance(value, int | float):
        raise ValueError
    if kind is int:
        if not float(value).is_integer():
            raise ValueError
        return int(value)
    return float(value)


def _bound(bound: float | str | None, values: Mapping[str, Any]) -> tuple[float, str]:
    """(numeric bound, how to print it)."""
    if isinstance(bound, str):
        return float(values[bound]), f"{bound}={values[bound]:g}"
    return float(bound), f"{bound:g}"


def _check_range(p: Param, value: float, values: Mapping[str, Any]) -> str | None:
    """Why ``value`` is out of the param's range, or None."""
    if math.isnan(value):
        return "must be a number, got nan"
    if p.low is not None:
        low, shown = _bound(p.low, values)
        if value < low or (p.low_open and value == low):
            return f"must be {'>' if p.low_open else '>='} {shown}, got {value:g}"
    if p.high is not None:
        high, shown = _bound(p.high, values)
        if value > high:
            return f"must be <= {shown}, got {value:g}"
    return None


def check_hyperparameters(objective: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` coerced to each hyperparameter's type; raises :class:`HyperparameterError` naming the
    first unknown, mistyped or out-of-range one (or a missing ``max_len`` for ``seq-mean-token-sum-norm``)."""
    spec = spec_of(objective)
    for name in given:
        if name not in spec:
            raise HyperparameterError(objective, name, f"unknown hyperparameter; valid: {', '.join(sorted(spec))}")
    coerced: dict[str, Any] = {}
    values = {name: p.default for name, p in spec.items()}  # defaults stand in for the bounds that name them
    for name, p in spec.items():  # spec order: a bound is named only after its own param
        if name not in given:
            continue
        value = given[name]
        if value is None and p.optional:
            coerced[name] = values[name] = None
            continue
        try:
            value = _coerce(p.kind, value)
        except ValueError:
            kind = {float: "a number", int: "an integer", str: "a string"}[p.kind]
            raise HyperparameterError(objective, name, f"must be {kind}{' or null' if p.optional else ''}, "
                                      f"got {given[name]!r}") from None
        if p.choices and value not in p.choices:
            raise HyperparameterError(objective, name, f"must be one of {', '.join(p.choices)}; got {value!r}")
        if p.kind is not str and (why := _check_range(p, value, values)) is not None:
            raise HyperparameterError(objective, name, why)
        coerced[name] = values[name] = value
    for shortcut, parts in EXCLUSIVE.get(ALIASES.get(objective, objective), []):
        both = [k for k in parts if values[k] is not None]
        if values[shortcut] is not None and both:
            raise HyperparameterError(objective, shortcut, f"sets {' and '.join(parts)} at once; "
                                      f"give it or them, not both ({both[0]} is given too)")
    if values["loss_agg"] == SUM_NORM and values["max_len"] is None:
        raise HyperparameterError(objective, "max_len", f"loss_agg {SUM_NORM!r} needs max_len (its constant length)")
    return coerced
