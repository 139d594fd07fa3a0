"""CLI flags take their defaults from the config they fill (one place each; tests/test_cli_flags.py freezes them)."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["default_of"]


def default_of(config: type, name: str) -> Any:
    """The default of field ``name`` of ``config`` (a dataclass or a pydantic model class).

    Raises:
        ValueError: ``config`` has no field ``name``, or the field has no default.
    """
    if dataclasses.is_dataclass(config):
        fields = {f.name: f for f in dataclasses.fields(config)}
        if name not in fields:
            raise ValueError(f"{config.__name__} has no field {name!r}")
        field = fields[name]
        if field.default is not dataclasses.MISSING:
            return field.default
        if field.default_factory is not dataclasses.MISSING:
            return field.default_factory()
        raise ValueError(f"{config.__name__}.{name} has no default")
    model_fields = getattr(config, "model_fields", None)
    if isinstance(model_fields, dict):
        if name not in model_fields:
            raise ValueError(f"{config.__name__} has no field {name!r}")
        info = model_fields[name]
        if info.is_required():
            raise ValueError(f"{config.__name__}.{name} has no default")
        return info.get_default(call_default_factory=True)
    raise ValueError(f"{config.__name__} is neither a dataclass nor a pydantic model")
