"""The checks of `tune.space`: each dimension is a valid Optuna distribution, each key names one params value."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def dimension_problem(dim: Any) -> str | None:
    """Why a `TuneConfig.Dimension` cannot be sampled (None when it can)."""
    if dim.type == "categorical":
        return None if dim.choices and dim.low is None and dim.high is None else \
            "a categorical dimension needs non-empty 'choices' and no low/high"
    if dim.low is None or dim.high is None or dim.low > dim.high or dim.choices is not None:
        return f"a {dim.type} dimension needs low <= high and no 'choices'"
    if dim.step is not None and dim.step <= 0:
        return "step must be above 0"
    if dim.log and (dim.low <= 0 or dim.step is not None):
        return "a log dimension needs low > 0 and no step"
    if dim.type == "int" and not all(float(v).is_integer() for v in (dim.low, dim.high, dim.step or 1)):
        return "an int dimension needs whole low, high and step"
    return None


def key_problem(schema: type[BaseModel], key: str) -> str | None:
    """Why a dotted key names no single value of the schema (None when it does)."""
    model: type[BaseModel] | None = schema
    parts = key.split(".")
    if parts[0] == "tune":
        return "cannot be tuned (it configures the tuning)"
    for i, part in enumerate(parts):
        if model is None:  # inside a free-form mapping such as loss.params: any key is fine
            return None
        field = model.model_fields.get(part)
        if field is None:
            return f"is not a params key ('{part}' is unknown)"
        kind, last = field.annotation, i == len(parts) - 1
        section = kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None
        is_mapping = getattr(kind, "__origin__", None) is dict
        if last:
            return "is a section, not a value" if section or is_mapping else None
        if not (section or is_mapping):
            return f"is not a params key ('{part}' is a value)"
        model = section
    return None
