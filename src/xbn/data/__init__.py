"""Datasets: format readers, the manifest table, the image dataset, the batch sampler and transforms.

Importing this package stays light (pandas and numpy, no torch): `ImageDataset` and `build_transform` load
torch, torchvision and timm only when first accessed.
"""

from __future__ import annotations

from typing import Any

from xbn.data.errors import DatasetError
from xbn.data.formats import READERS, read_dataset
from xbn.data.manifest import (
    SPLITS,
    carve_validation,
    encode_labels,
    read_manifest,
    safe_relative_path,
    write_manifest,
)
from xbn.data.sampler import ClassBalancedBatchSampler

_LAZY = {"ImageDataset": "xbn.data.dataset", "build_transform": "xbn.data.transforms"}

__all__ = [
    "READERS",
    "SPLITS",
    "ClassBalancedBatchSampler",
    "DatasetError",
    "ImageDataset",
    "build_transform",
    "carve_validation",
    "encode_labels",
    "read_dataset",
    "read_manifest",
    "safe_relative_path",
    "write_manifest",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'xbn.data' has no attribute {name!r}")
