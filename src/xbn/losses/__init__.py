"""Losses and miners by name, from pytorch-metric-learning: any `losses.X` / `miners.X` with its keyword params."""

from __future__ import annotations

from typing import Any

from pytorch_metric_learning import losses, miners
from torch import nn


def _build(module, kind: str, name: str, params: dict[str, Any]) -> nn.Module:
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        known = sorted(n for n in dir(module) if n[0].isupper() and not n.startswith("Base"))
        raise ValueError(f"unknown {kind} '{name}'; pytorch-metric-learning has: {', '.join(known)}")
    try:
        return cls(**params)
    except TypeError as exc:
        raise ValueError(f"{kind} '{name}' does not accept params {params}: {exc}") from None


def build_loss(name: str, params: dict[str, Any] | None = None) -> nn.Module:
    return _build(losses, "loss.name", name, params or {})


def build_miner(name: str | None, params: dict[str, Any] | None = None) -> nn.Module | None:
    return None if name is None else _build(miners, "loss.miner", name, params or {})
