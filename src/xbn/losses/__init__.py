"""Losses and miners by name, from pytorch-metric-learning: any `losses.X` / `miners.X` with its keyword params.

Miners are looked up first among ours (`xbn.losses.miners`: Roth et al. 2020's RandomTripletMiner and
SoftHardMiner, which PML lacks), then in PML. `loss_class`/`miner_class` and `check_arguments` resolve a name
and its params without building anything; `xbn.config.check_names` runs them when params load, so a bad name
or argument fails with its key before any data is read (a `ConfigError`, exit 2)."""

from __future__ import annotations

import inspect
from typing import Any

from pytorch_metric_learning import losses
from pytorch_metric_learning import miners as pml_miners
from torch import nn

# Importing the submodule binds the package attribute `miners` to it: PML's module is `pml_miners` here.
from xbn.config import ConfigError, close_matches
from xbn.losses import miners as own_miners
from xbn.losses.xbm_contrastive import XBMContrastiveLoss

OWN_MINERS = ("RandomTripletMiner", "SoftHardMiner")
# Ours, looked up before PML's: the official XBM code's contrastive loss.
OWN_LOSSES = {"XBMContrastiveLoss": XBMContrastiveLoss}
# Filled in by build_loss from the data and model.embedding_dim: never required from loss.params.
FILLED_LOSS_ARGUMENTS = ("num_classes", "embedding_size")


def _classes(module) -> list[str]:
    return sorted(n for n, c in vars(module).items()
                  if isinstance(c, type) and issubclass(c, nn.Module) and not n.startswith("Base"))


def _unknown(key: str, kind: str, name: str, known: dict[str, list[str]]) -> ConfigError:
    every = [n for names in known.values() for n in names]
    if matches := close_matches(name, every):
        hint = f"close matches: {', '.join(matches)}"
    else:
        hint = "; ".join(f"{where} has: {', '.join(names)}" for where, names in known.items())
    return ConfigError(f"{key}: unknown {kind} '{name}'; {hint}")


def loss_class(name: str) -> type[nn.Module]:
    """Our loss `name` (OWN_LOSSES), else pytorch-metric-learning's; a ConfigError naming loss.name (with the
    close matches) if neither has it."""
    cls = OWN_LOSSES.get(name) or getattr(losses, name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)) or name.startswith("Base"):
        raise _unknown("loss.name", "loss", name, {"pytorch-metric-learning": _classes(losses),
                                                   "xbn": list(OWN_LOSSES)})
    return cls


def miner_class(name: str) -> type[nn.Module]:
    """Our miner `name`, else pytorch-metric-learning's; a ConfigError naming loss.miner if neither has it."""
    module = own_miners if name in OWN_MINERS else pml_miners
    cls = getattr(module, name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)) or name.startswith("Base"):
        raise _unknown("loss.miner", "miner", name,
                       {"pytorch-metric-learning": _classes(pml_miners), "xbn": list(OWN_MINERS)})
    return cls


def check_arguments(cls: type, params: dict[str, Any], key: str, filled: tuple[str, ...] = (),
                    owner: str | None = None) -> None:
    """ConfigError naming `key`.<arg> for an entry of `params` that `cls` takes nowhere along its MRO (its
    __init__ or the ones it hands **kwargs on to), and naming `key` for a required argument left out.
    `owner` says where the class comes from (e.g. `loss.name=SupConLoss`; default: the class name)."""
    owner = owner or cls.__name__
    accepted = _init_arguments(cls) - {"self", "args", "kwargs"}
    for arg in sorted(set(params) - accepted):
        hint = f"close matches: {', '.join(m)}" if (m := close_matches(arg, accepted)) else \
            f"it takes: {', '.join(sorted(accepted))}"
        raise ConfigError(f"{key}.{arg}: {owner} takes no argument '{arg}'; {hint}")
    own = next(vars(c)["__init__"] for c in cls.__mro__ if "__init__" in vars(c))
    missing = [p.name for p in inspect.signature(own).parameters.values()
               if p.name != "self" and p.default is p.empty and p.name not in params and p.name not in filled
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        raise ConfigError(f"{key}: {owner} needs {', '.join(f'{key}.{m}' for m in missing)}")


def _build(cls: type, key: str, params: dict[str, Any]) -> nn.Module:
    try:
        return cls(**params)
    except TypeError as exc:
        raise ValueError(f"{key} '{cls.__name__}' does not accept params {params}: {exc}") from None


def _init_arguments(cls: type) -> set[str]:
    # Along the MRO: CosFaceLoss takes *args/**kwargs and hands num_classes on to LargeMarginSoftmaxLoss.
    return {name for c in cls.__mro__ if "__init__" in vars(c)
            for name in inspect.signature(vars(c)["__init__"]).parameters}


def build_loss(name: str, params: dict[str, Any] | None = None, *, num_classes: int | None = None,
               embedding_size: int | None = None) -> nn.Module:
    """A PML loss; classification/proxy losses get `num_classes` (training classes) and `embedding_size`
    (model.embedding_dim) unless loss.params sets them, and must agree with them if it does."""
    params = dict(params or {})
    cls = loss_class(name)
    accepted = _init_arguments(cls)
    for key, value in zip(FILLED_LOSS_ARGUMENTS, (num_classes, embedding_size)):
        if key not in accepted or value is None:
            continue
        if key in params and params[key] != value:
            source = "the training classes" if key == "num_classes" else "model.embedding_dim"
            raise ValueError(f"loss.params.{key}={params[key]} but {source} give {value}: "
                             f"leave loss.params.{key} out")
        params[key] = value
    return _build(cls, "loss.name", params)


def build_miner(name: str | None, params: dict[str, Any] | None = None) -> nn.Module | None:
    if name is None:
        return None
    return _build(miner_class(name), "loss.miner", params or {})
