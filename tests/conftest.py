"""Shared fixtures: a tiny generated glyph set and params for a tiny model, so end-to-end tests stay fast."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "data.glyphs.classes=24", "data.glyphs.images_per_class=4", "data.glyphs.image_size=32",
    "data.image_size=32", "data.num_workers=0", "data.val_classes=0.25",
    "model.backbone=test_efficientnet", "model.pretrained=none", "model.embedding_dim=16",
    "train.epochs=2", "train.warmup_epochs=1", "train.batch_size=16", "train.samples_per_class=4",
    "train.log_every=1", "train.probe_size=8", "eval.k=[1, 2, 4]", "eval.batch_size=32",
]


@pytest.fixture(scope="session")
def glyph_root(tmp_path_factory) -> Path:
    from xbn.data.glyphs import generate_glyphs

    root = tmp_path_factory.mktemp("glyphs") / "glyphs"
    generate_glyphs(root, classes=24, images_per_class=4, image_size=32, seed=0)
    return root


@pytest.fixture
def tiny_params(tmp_path, glyph_root, monkeypatch):
    """Params for a tiny run in tmp_path (the working directory) on the shared tiny glyph set."""
    from xbn.config import load_params

    monkeypatch.chdir(tmp_path)

    def make(*overrides: str):
        return load_params(ROOT / "params.yaml", [*TINY, f"data.root={glyph_root}", *overrides])

    return make
