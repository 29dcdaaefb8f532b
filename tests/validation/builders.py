"""A tiny valid dataset on disk (distinct PNG and JPEG images per row) and ways to break it."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image

# label -> split: two train classes, one val class, two test classes; two images each.
CLASSES = {"ant": "train", "bee": "train", "cat": "val", "dog": "test", "eel": "test"}


def write_image(path: Path, seed: int, size: tuple[int, int] = (16, 12)) -> Path:
    """Random pixels from `seed`, so no two images share bytes unless a test copies one on purpose."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    fmt = "JPEG" if path.suffix.lower() in (".jpg", ".jpeg") else "PNG"
    Image.fromarray(pixels).save(path, format=fmt)
    return path


def jpeg_bytes(seed: int, size: tuple[int, int] = (64, 48)) -> bytes:
    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def build_dataset(root: Path) -> pd.DataFrame:
    """Write the images under `root/images/` and return the manifest (rows 0-9 in `CLASSES` order)."""
    rows = []
    for label, split in CLASSES.items():
        for j, ext in enumerate((".png", ".jpg")):
            rel = f"images/{label}/{j}{ext}"
            write_image(root / rel, seed=len(rows))
            rows.append((rel, label, split))
    return pd.DataFrame(rows, columns=["path", "label", "split"]).astype(str)


def row_of(frame: pd.DataFrame, path: str) -> int:
    return int(frame.index[frame["path"] == path][0])
