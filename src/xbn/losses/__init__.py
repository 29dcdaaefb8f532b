"""Losses and miners by name, from pytorch-metric-learning: any `losses.X` / `miners.X` with its keyword params.

Miners are looked up first among ours (`xbn.losses.miners`: Roth et al. 2020's RandomTripletMiner and
SoftHardMiner, which PML lacks), then in PML."""

from __future__ import annotations

import inspect
from typing import Any

from pytorch_metric_learning import losses
from pytorch_metric_learning import miners as pml_miners
from torch import nn

# Importing the submodule binds the package attribute `miners` to it: PML's module is `pml_miners` here.
from xbn.losses import miners as own_miners

OWN_MINERS = ("RandomTripletMiner", "SoftHardMiner")


def _build(module, kind: str, name: str, params: dict[str, Any]) -> nn.Module:
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        known = sorted(n for n in dir(module) if n[0].isupper() and not n.startswith("Base"))
        raise ValueError(f"unknown {kind} '{name}'; pytorch-metric-learning has: {', '.join(known)}")
    try:
        return cls(**params)
    except TypeError as exc:
        raise ValueError(f"{kind} '{name}' does not accept params {params}: {exc}") from None


def _init_arguments(cls: type) -> set[str]:
    # Along the MRO: CosFaceLoss takes *args/**kwargs and hands num_classes on to LargeMarginSoftmaxLoss.
    return {name for c in cls.__mro__ if "__init__" in vars(c)
            for name in inspect.signature(c.__init__).parameters}


def build_loss(name: str, params: dict[str, Any] | None = None, *, num_classes: int | None = None,
               embedding_size: int | None = None) -> nn.Module:
    """A PML loss; classification/proxy losses get `num_classes` (training classes) and `embedding_size`
    (model.embedding_dim) unless loss.params sets them, and must agree with them if it does."""
    params = dict(params or {})
    cls = getattr(losses, name, None)
    if isinstance(cls, type):
        accepted = _init_arguments(cls)
        for key, value in (("num_classes", num_classes), ("embedding_size", embedding_size)):
            if key not in accepted or value is None:
                continue
            if key in params and params[key] != value:
                source = "the training classes" if key == "num_classes" else "model.embedding_dim"
                raise ValueError(f"loss.params.{key}={params[key]} but {source} give {value}: "
                                 f"leave loss.params.{key} out")
            params[key] = value
    return _build(losses, "loss.name", name, params)


def build_miner(name: str | None, params: dict[str, Any] | None = None) -> nn.Module | None:
    if name is None:
        return None
    if name in OWN_MINERS:
        return _build(own_miners, "loss.miner", name, params or {})
    try:
        return _build(pml_miners, "loss.miner", name, params or {})
    except ValueError as exc:
        if not str(exc).startswith("unknown"):
            raise
        raise ValueError(f"{exc}; xbn has: {', '.join(OWN_MINERS)}") from None
