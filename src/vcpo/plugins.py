"""A user's own objective, task or environment, and reward, named in the config by import path
(``module.sub:name``) and imported without forking vcpo (docs/extending.md). Torch-free.

A path's module is imported the usual way (an installed package, or a directory on ``PYTHONPATH``); when it is
found nowhere, the working directory is appended to ``sys.path`` and the import tried again, as ``python -m``
would find it. Worker processes (spawned) and Ray actors inherit that ``sys.path``, and the sandboxed reward
workers read the modules from it, so every process of a run imports the same object.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from vcpo.errors import UserError

IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
"""``package.module:attribute`` (the attribute may be dotted: ``module:Class.factory``)."""
WHERE_HINT = "install it, put its directory on PYTHONPATH, or run vcpo from the directory that holds it"


class PluginError(UserError, ValueError):
    """An import path that cannot be used: ``path`` and one line saying why (``reason``)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path!r}: {reason}")
        self.path, self.reason = path, reason


def is_import_path(name: str) -> bool:
    """Whether a config name is an import path (``module:name``) rather than a built-in name."""
    return IMPORT_PATH.fullmatch(name) is not None


def load_object(path: str) -> Any:
    """The object that ``path`` (``module.sub:name``) names, its module imported; :class:`PluginError` if the
    path is malformed, the module cannot be imported (or raises while it is), or it has no such attribute."""
    if not is_import_path(path):
        raise PluginError(path, "is not an import path of the form module.sub:name")
    module_name, _, attribute = path.partition(":")
    obj: Any = _import(module_name, path)
    for i, part in enumerate(attribute.split(".")):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            owner = ".".join([module_name, *attribute.split(".")[:i]])
            raise PluginError(path, f"{owner!r} has no attribute {part!r}") from None
    return obj


def load_function(path: str, arguments: tuple[str, ...]) -> Callable[..., Any]:
    """The function at ``path``, checked to accept the positional ``arguments`` (their names are for messages)."""
    fn = load_object(path)
    if not callable(fn) or isinstance(fn, type):
        raise PluginError(path, f"is {type(fn).__name__} {fn!r}, not a function")
    try:
        signature = inspect.signature(fn)
    except ValueError:  # a builtin without a signature: its first call will tell
        return fn
    try:
        signature.bind(*arguments)
    except TypeError:
        raise PluginError(path, f"must accept ({', '.join(arguments)}); its signature is {signature}") from None
    return fn


def _import(module_name: str, path: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except Exception as exc:
        if not (_missing_itself(exc, module_name) and _add_working_directory()):
            raise PluginError(path, _failure(exc, module_name)) from None
    try:  # again, with the working directory on the path
        return importlib.import_module(module_name)
    except Exception as exc:
        raise PluginError(path, _failure(exc, module_name)) from None


def _missing_itself(exc: Exception, module_name: str) -> bool:
    """Whether ``exc`` says that the module (or a package above it) does not exist, as opposed to something that
    the module imports."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    return missing is not None and (module_name + ".").startswith(missing + ".")


def _failure(exc: Exception, module_name: str) -> str:
    if _missing_itself(exc, module_name):
        return f"no module named {exc.name!r} ({WHERE_HINT})"
    return f"importing {module_name!r} failed: {one_line(exc)}"


def _add_working_directory() -> bool:
    """Append the working directory to ``sys.path`` unless it is on it already; whether it was added."""
    cwd = os.path.realpath(os.getcwd())
    if "" in sys.path or cwd in {os.path.realpath(p) for p in sys.path if p}:
        return False
    sys.path.append(cwd)
    importlib.invalidate_caches()
    return True


def one_line(exc: BaseException) -> str:
    """``Type: first line`` of an error raised by a user's module."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
