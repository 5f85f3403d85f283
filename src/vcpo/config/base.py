"""The pieces every section shares: the one-line ``ConfigError`` and the strict base model."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from vcpo.errors import UserError


class ConfigError(UserError, ValueError):
    """A user-fixable problem with the configuration; its message is one line naming the culprit."""


class _Strict(BaseModel):
    # use_attribute_docstrings: the string under each field is its description (`vcpo config show`, docs/config.md).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


