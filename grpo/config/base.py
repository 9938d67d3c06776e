"""What every config section shares: unknown keys are an error, every field's docstring is its description."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message says how to fix it."""


class Section(BaseModel):
    """Base of every config section: unknown keys are rejected, docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, allow_inf_nan=False)
