"""Models: timm backbones with offline ImageNet weights, and the embedding model built on them."""

from xbn.models.backbone import OFFLINE_WEIGHTS, create_backbone, lukemelas_to_timm
from xbn.models.embedder import (
    CHECKPOINT_FORMAT,
    Embedder,
    InitialWeights,
    build_embedder,
    load_embedder,
    save_embedder,
)

__all__ = [
    "CHECKPOINT_FORMAT",
    "OFFLINE_WEIGHTS",
    "Embedder",
    "InitialWeights",
    "build_embedder",
    "create_backbone",
    "load_embedder",
    "lukemelas_to_timm",
    "save_embedder",
]
