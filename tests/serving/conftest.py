"""Shared fixtures: a tiny real embedder saved as `xbn train` saves it, and a folder of real PNG images."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from serving_support import CLASSES, IMAGE_SIZE, PER_CLASS, draw, save_tiny_model

from xbn.serving.index import IndexConfig, build_catalogue
from xbn.serving.model import load_served_model
from xbn.serving.sources import read_source


@pytest.fixture(scope="session")
def model_path(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("model") / "model.pt", seed=0)


@pytest.fixture(scope="session")
def other_model_path(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("model2") / "model.pt", seed=1)


@pytest.fixture(scope="session")
def served(model_path):
    from xbn.serving.model import load_served_model

    return load_served_model(model_path, IMAGE_SIZE)


@pytest.fixture(scope="session")
def image_root(tmp_path_factory) -> Path:
    """CLASSES x PER_CLASS images under class folders, and a manifest CSV (all rows `test`) beside them."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    rows = []
    for c in range(CLASSES):
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        for i in range(PER_CLASS):
            rel = f"class{c}/img{i}.png"
            draw(root / rel, colour, seed=c * 100 + i, mode="L" if (c + i) % 5 == 0 else "RGB")
            rows.append({"path": rel, "label": f"class{c}", "split": "test"})
    pd.DataFrame(rows).to_csv(root / "manifest.csv", index=False)
    return root


@pytest.fixture
def broken_image(tmp_path) -> Path:
    """A PNG cut short: its header says image, its pixels are missing."""
    full = draw(tmp_path / "whole.png", (10, 200, 30), seed=7)
    cut = tmp_path / "truncated.png"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    return cut


@pytest.fixture(autouse=True)
def one_faiss_thread():
    """faiss's OpenMP threads spin-wait: on a loaded 2-core machine two of them train k-means several times
    slower than one. One thread keeps these small indexes fast and their timing steady."""
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


@pytest.fixture(scope="module")
def versions(model_path, other_model_path, image_root, tmp_path_factory):
    """Two 'versions': each a checkpoint and the catalogue index it built, in folders of their own."""
    frame, root = read_source(image_root / "manifest.csv")
    out = {}
    for name, path in (("a", model_path), ("b", other_model_path)):
        folder = tmp_path_factory.mktemp(f"version_{name}")
        shutil.copy(path, folder / "model.pt")
        build_catalogue(load_served_model(path, IMAGE_SIZE), frame, root, IndexConfig()).save(
            folder / "index"
        )
        out[name] = folder
    return out
