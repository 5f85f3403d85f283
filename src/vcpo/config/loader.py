"""Reading, overriding, validating and saving a config: YAML files, dotted command-line overrides."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from vcpo.config.base import ConfigError
from vcpo.config.recipe import recipe_default
from vcpo.config.root import Config
from vcpo.errors import DiskError

log = logging.getLogger("vcpo.config")


KWARGS_OF_NAME = {"task.name": "task.kwargs", "objective.name": "objective.kwargs"}
"""Keys whose ``kwargs`` belong to the named thing: an override that changes the name drops the file's kwargs."""


def _section_of(dotted: str) -> type[BaseModel] | None:
    """The model class of a config section (``trainer``, ``trainer.ess_lr``), None for a leaf or an unknown key."""
    model: type[BaseModel] | None = Config
    for key in dotted.split("."):
        fields = {f.alias or name: f for name, f in model.model_fields.items()} if model else {}
        field = fields.get(key)
        annotation = field.annotation if field is not None else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if model is None:
            return None
    return model


def _merge(into: dict[str, Any], value: dict[str, Any], dotted: str) -> None:
    """Deep-merge ``value`` into a section, replacing leaves; a dict-typed leaf (``kwargs``) is replaced whole."""
    for key, item in value.items():
        if isinstance(item, dict) and _section_of(f"{dotted}.{key}") is not None and isinstance(into.get(key), dict):
            _merge(into[key], item, f"{dotted}.{key}")
        else:
            into[key] = item


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set one override: a leaf (a dict-typed one such as ``task.kwargs`` too) is replaced; a mapping given for a
    section (``trainer={lr: 1e-3}``) is merged into what the file set there."""
    keys = dotted.split(".")
    node = tree
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {'.'.join(keys[: i + 1])} is not a section")
        node = child
    if isinstance(value, dict) and isinstance(node.get(keys[-1]), dict) and _section_of(dotted) is not None:
        _merge(node[keys[-1]], value, dotted)
    else:
        node[keys[-1]] = value


def _get_dotted(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> list[str]:
    """Apply dotted overrides to a config tree read from a file, in place.

    ``task.name`` or ``objective.name`` set to another name than the file's (or the default's) first drops the
    file's ``task.kwargs`` / ``objective.kwargs``: they were written for the old task or objective. Kwargs given as
    overrides (``task.kwargs.path=...``) apply after that, whatever their order on the command line. Returns one note
    per non-empty kwargs dropped (``load_config`` logs them once the config is valid).
    """
    parsed, notes = parse_overrides(overrides), []
    for name_key, kwargs_key in KWARGS_OF_NAME.items():
        section, field = name_key.split(".")
        names = [value for key, value in parsed if key == name_key]
        current = _get_dotted(tree, name_key)
        if current is None:
            current = recipe_default(tree, name_key) or _section_of(section).model_fields[field].default
        if names and names[-1] != current and isinstance(tree.get(section), dict):
            dropped = tree[section].pop(kwargs_key.split(".")[1], None)
            if dropped:
                keys = ", ".join(map(str, dropped)) if isinstance(dropped, dict) else repr(dropped)
                notes.append(f"note: {name_key}={names[-1]} replaces {current}, so the file's {kwargs_key} ({keys}) "
                             f"are dropped; give the new one its own as {kwargs_key}.KEY=VALUE")
    for key, value in parsed:
        _set_dotted(tree, key, value)
    return notes


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """``["a.b=1", "c=x"]`` -> ``[("a.b", 1), ("c", "x")]``; values are parsed as YAML scalars."""
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: cannot parse value ({exc.__class__.__name__})") from None
        parsed.append((key.strip(), value))
    return parsed


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "config"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        return f"unknown config key {where!r}"
    if not err["loc"] or (err["type"] == "value_error" and isinstance(err.get("input"), dict)):
        return msg  # a cross-field check of the config or of a section: its message already names the key
    return f"config key {where!r}: {msg} (got {err.get('input')!r})"


def config_from_dict(tree: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_first_error(exc)) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or start from defaults), apply dotted overrides, validate. Kwargs an override of
    ``task.name`` / ``objective.name`` dropped are said in one warning line each on the ``vcpo.config`` logger (on
    stderr when nothing configured logging), after validation, so that a bad config still fails in one line."""
    return _validated({} if path is None else _read(Path(path)), overrides)


def load_run_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """``load_config`` for the config.yaml a run saved (``--resume``, ``vcpo rerun``). One saved before ``recipe``
    existed has no ``recipe`` key and was run with the defaults of its time, the ``paper`` recipe's: it gets them
    back, so an old run resumes and reruns as it ran."""
    tree = _read(Path(path))
    tree.setdefault("recipe", "paper")
    return _validated(tree, overrides)


def _read(p: Path) -> dict[str, Any]:
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        tree = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        where = _yaml_where(exc)
        raise ConfigError(f"config file {str(p)!r}{where} is not valid YAML: {_yaml_problem(exc)}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {exc}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    return tree


def _validated(tree: dict[str, Any], overrides: list[str] | None) -> Config:
    notes = apply_overrides(tree, overrides or [])
    config = config_from_dict(tree)
    for note in notes:
        log.warning(note)
    return config


def _yaml_where(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    return f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def _yaml_problem(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None)
    return " ".join(str(problem or exc).split())


def save_config(config: Config, path: str | Path) -> None:
    """Write ``config.yaml`` atomically (a temporary file renamed over it): a crash never leaves half a config."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(yaml.safe_dump(config.to_dict(), sort_keys=False))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DiskError(path, e) from None
