"""The embedding model: a timm backbone plus a linear head, giving L2-normalised float32 embeddings.

Metric-learning batches are small and class-balanced, so their BatchNorm statistics are a poor estimate of the
ImageNet ones the backbone was trained with; `freeze_bn` keeps every BatchNorm layer on its pretrained
statistics and affine parameters, whatever mode the trainer puts the model in.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from xbn.config import ConfigError, ModelConfig
from xbn.models.backbone import create_backbone, load_state_dict_strict
from xbn.utils.integrity import remove_sidecar, verify_sidecar, write_sidecar
from xbn.utils.io import save_torch
from xbn.utils.locks import fence

CHECKPOINT_FORMAT = "xbn-embedder/1"
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class Embedder(nn.Module):
    """`backbone` (pooled features, `num_features` wide) -> linear head -> unit-norm `embedding_dim`."""

    def __init__(self, backbone: nn.Module, embedding_dim: int, freeze_bn: bool = True) -> None:
        super().__init__()
        self.backbone = backbone
        # A timm model's plain int attribute, which nn.Module's __getattr__ types as a Tensor or a Module.
        self.head = nn.Linear(cast(int, backbone.num_features), embedding_dim)
        self.embedding_dim = embedding_dim
        self.freeze_bn = freeze_bn
        if freeze_bn:
            for bn in self._batchnorms():
                bn.requires_grad_(False)
        self.train()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        embeddings = self.head(self.backbone(images))
        # Normalising in half precision loses the unit norm the losses and the memory rely on.
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            return F.normalize(embeddings.float(), dim=-1)

    def train(self, mode: bool = True) -> Embedder:
        """Set train/eval mode; with `freeze_bn` every BatchNorm layer stays in eval mode (stats fixed)."""
        super().train(mode)
        if self.freeze_bn:
            for bn in self._batchnorms():
                bn.eval()
        return self

    def head_parameters(self) -> Iterator[nn.Parameter]:
        return self.head.parameters()

    def backbone_parameters(self) -> list[nn.Parameter]:
        """The backbone's trainable parameters (frozen BatchNorm ones excluded), frozen for now or not."""
        frozen = {id(p) for bn in self._batchnorms() for p in bn.parameters()} if self.freeze_bn else set()
        return [p for p in self.backbone.parameters() if id(p) not in frozen]

    def set_backbone_trainable(self, trainable: bool) -> None:
        """Freeze or unfreeze the backbone (e.g. to warm up a fresh head); frozen BatchNorms stay frozen."""
        for p in self.backbone_parameters():
            p.requires_grad_(trainable)

    def _batchnorms(self) -> list[nn.Module]:
        return [m for m in self.modules() if isinstance(m, _BATCHNORMS)]


def build_embedder(model_cfg: ModelConfig) -> tuple[Embedder, dict[str, Any]]:
    """The embedder described by the `model` params section, and its backbone's data config."""
    backbone, data_config = create_backbone(
        model_cfg.backbone, model_cfg.pretrained, model_cfg.pretrained_path, num_classes=0
    )
    return Embedder(backbone, model_cfg.embedding_dim, freeze_bn=model_cfg.freeze_bn), data_config


def save_embedder(
    path: str | Path,
    embedder: Embedder,
    model_cfg: ModelConfig,
    data_config: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> None:
    """Write the trained embedder atomically, as plain types and tensors only (loadable with weights_only), then
    its sha256 sidecar `<path>.sha256`, which `load_embedder` checks."""
    checkpoint: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "model": model_cfg.model_dump(),
        "data_config": dict(data_config),
        "state_dict": {k: v.detach().cpu() for k, v in embedder.state_dict().items()},
    }
    extra = extra or {}
    if clash := sorted(set(extra) & set(checkpoint)):
        raise ValueError(f"extra keys {clash} would overwrite the checkpoint's own entries")
    checkpoint.update(extra)
    _check_plain(checkpoint, "checkpoint")
    fence()  # before the old file's sidecar goes: a run that lost its lock leaves another run's model whole
    remove_sidecar(path)
    save_torch(path, checkpoint)
    write_sidecar(path)


def load_embedder(
    path: str | Path, map_location: str | torch.device = "cpu", verify: bool = True
) -> tuple[Embedder, dict[str, Any], dict[str, Any]]:
    """Rebuild a saved embedder (in eval mode), its data config and the whole checkpoint dict.

    `verify`: check the file against its sidecar sha256 before torch.load reads it (`IntegrityError` naming the
    file on a mismatch; no sidecar: a warning). False only where the caller has just verified it against another
    record (a registry version's tag).

    The backbone is built without pretrained weights: the checkpoint holds all of them, so loading needs
    neither the offline-weights package nor the network.
    """
    if verify:
        verify_sidecar(path)
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except OSError:
        raise
    except Exception as exc:  # torch.load fails on foreign bytes with any of half a dozen exception types
        raise ValueError(f"{path} is not an xbn embedder checkpoint: torch.load refused it ({exc})") from exc
    found = checkpoint.get("format") if isinstance(checkpoint, dict) else type(checkpoint).__name__
    if found != CHECKPOINT_FORMAT:
        raise ValueError(
            f"{path} is not an xbn embedder checkpoint: format {found!r}, expected {CHECKPOINT_FORMAT!r}"
        )
    model_cfg = ModelConfig.model_validate(checkpoint["model"])
    embedder, _ = build_embedder(model_cfg.model_copy(update={"pretrained": "none", "pretrained_path": None}))
    load_state_dict_strict(embedder, checkpoint["state_dict"], str(path))
    return embedder.to(map_location).eval(), dict(checkpoint["data_config"]), checkpoint


@dataclass(frozen=True)
class InitialWeights:
    """The trained weights a fine-tuning starts from (`train.init`): an xbn model.pt whose sha256 was checked,
    and where it came from, recorded in the model trained from it so its lineage can be followed back."""

    path: Path
    source: str  # "champion", or the path the params gave
    sha256: str
    version: int | None = None  # the registry version (a champion)

    def check(self, model_cfg: ModelConfig) -> None:
        """A ConfigError naming both values when the weights cannot go into the model the params describe."""
        saved = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True).get("model") or {}
        for key in ("backbone", "embedding_dim"):
            if saved.get(key) != getattr(model_cfg, key):
                raise ConfigError(f"train.init={self.source}: {self.describe()} has model.{key}={saved.get(key)!r}, "
                                  f"the params ask for {getattr(model_cfg, key)!r}: fine-tune with the same "
                                  f"model.{key}, or train from train.init=pretrained")

    def load_into(self, embedder: Embedder, model_cfg: ModelConfig) -> None:
        self.check(model_cfg)
        checkpoint = torch.load(self.path, map_location="cpu", weights_only=True)
        load_state_dict_strict(embedder, checkpoint["state_dict"], str(self.path))

    def describe(self) -> str:
        return f"v{self.version} ({self.path})" if self.version is not None else str(self.path)

    def record(self) -> dict[str, Any]:
        return {"from": self.source, "version": self.version, "model_sha256": self.sha256}


def _check_plain(value: Any, where: str) -> None:
    # torch.load(weights_only=True) refuses anything else: fail when saving, not when a later stage loads.
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where}: key {key!r} is not a str or int")
            _check_plain(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
    # Exact types: subclasses such as numpy.float64 (a float) are pickled as themselves and refused on load.
    elif not (value is None or type(value) in (bool, int, float, str) or isinstance(value, torch.Tensor)):
        raise TypeError(
            f"{where} is a {type(value).__name__}; a checkpoint holds only plain types and tensors"
        )
