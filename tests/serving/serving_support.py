"""Helpers of the serving tests, importable by name (a `conftest` import is ambiguous across folders)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

IMAGE_SIZE = 32
CLASSES, PER_CLASS = 6, 4


def save_tiny_model(path: Path, seed: int) -> Path:
    from xbn.config import ModelConfig
    from xbn.models import build_embedder, save_embedder

    torch.manual_seed(seed)
    cfg = ModelConfig(backbone="test_efficientnet", pretrained="none", embedding_dim=16)
    model, data_config = build_embedder(cfg)
    save_embedder(path, model, cfg, data_config)
    return path


def draw(path: Path, colour: tuple[int, int, int], seed: int, mode: str = "RGB") -> Path:
    """A noisy image of one dominant colour (the class), so classes embed apart even untrained."""
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.array(colour)[None, None] + rng.normal(0, 25, (40, 48, 3)), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).convert(mode).save(path)
    return path
