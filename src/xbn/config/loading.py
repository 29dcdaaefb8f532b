"""Reading params.yaml: YAML, then the overrides, then the schema; every problem a `ConfigError` by key."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from xbn.config.errors import ConfigError, close_matches
from xbn.config.overrides import apply_overrides
from xbn.config.schema import Params


def load_params(path: str | Path | None = "params.yaml", overrides: list[str] | None = None) -> Params:
    """The validated params of `path` with `overrides`. The names they give (loss, miner, backbone, device)
    are resolved against the installed libraries by `xbn.stages.names.check_names`, a layer up."""
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"params file not found: {path} (`xbn init --dataset FORMAT --root FOLDER` writes "
                              f"one into the current folder)")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a mapping of sections")
    raw = apply_overrides(raw, overrides)
    try:
        params = Params.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None
    return params


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = _dotted_key(e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            hint = _closest(e["loc"])
            lines.append(f"unknown key '{key}'" + (f" (did you mean '{hint}'?)" if hint else ""))
        elif e["type"] == "value_error" and isinstance(e.get("input"), dict):  # a check across keys: its message names them
            lines.append(e["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"{key}: {e['msg']} (got {e.get('input')!r})")
    return "invalid params: " + "; ".join(lines)


def _dotted_key(loc: tuple) -> str:
    """The params key of an error's `loc`, less the tags pydantic adds for the member of a union it tried
    (`train.channels_last.literal['auto']` -> `train.channels_last`): the key is what a user can look up."""
    parts: list[str] = []
    annotation: Any = Params  # a field's annotation: a model, a union, any other type form
    for part in loc:
        members = [a for a in get_args(annotation) if a is not type(None)]
        if get_origin(annotation) in (Union, types.UnionType) and len(members) > 1:
            annotation = None  # `part` names the member tried, not a key; below it, nothing to resolve
            continue
        parts.append(str(part))
        field = (annotation.model_fields.get(str(part))
                 if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None)
        annotation = field.annotation if field is not None else None
    return ".".join(parts)


def _closest(loc: tuple) -> str | None:
    """The dotted key of the schema closest to an unknown one (`train.epoch` -> `train.epochs`), or None."""
    model: type[BaseModel] = Params
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None  # inside a free-form mapping: any key goes there
        model = annotation
    matches = close_matches(str(loc[-1]), model.model_fields)
    return ".".join([*(str(p) for p in loc[:-1]), matches[0]]) if matches else None


def flatten(params: BaseModel | dict, prefix: str = "") -> dict[str, Any]:
    """`{"memory": {"kalman": {"r": 1}}}` -> `{"memory.kalman.r": 1}` (for tracking and hashing)."""
    data = params.model_dump() if isinstance(params, BaseModel) else params
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out

