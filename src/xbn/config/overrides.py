"""`--set key.sub=value` overrides, applied to the raw params before the schema validates them."""

from __future__ import annotations

import copy
from typing import Any

import yaml

from xbn.config.errors import ConfigError


def _parse_value(text: str) -> Any:
    # YAML gives "3" -> 3, "1e-3" -> 0.001, "[1, 2]" -> list, "null" -> None, anything else a string.
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def apply_overrides(raw: dict, overrides: list[str] | None) -> dict:
    """Apply `key.sub=value` overrides. Unknown keys are left for the schema to refuse by their dotted name."""
    raw = copy.deepcopy(raw)
    for item in overrides or []:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override '{item}' is not of the form key=value")
        *sections, leaf = key.strip().split(".")
        target = raw
        for part in sections:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"override '{item}': '{part}' is a value, not a section")
        try:
            target[leaf] = _parse_value(text)
        except yaml.YAMLError as exc:  # e.g. an unclosed bracket or a control character
            problem = str(exc).splitlines()[0]
            raise ConfigError(f"override '{key.strip()}': {text!r} is not a valid value ({problem})") from None
    return raw
