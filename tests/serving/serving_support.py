"""Helpers of the serving tests, importable by name (a `conftest` import is ambiguous across folders)."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

from xbn.serving.http import LocalModelSource
from xbn.serving.index import CatalogueIndex

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


@contextlib.contextmanager
def running(app):
    """The app on a real uvicorn server in a thread, on a free port of 127.0.0.1."""
    from xbn.serving.http import bound_port, make_server

    server = make_server(app, "127.0.0.1", 0, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        # 120 s: a first search loads the model, and a loaded 2-core machine took over 30 s for one.
        with httpx.Client(base_url=f"http://127.0.0.1:{bound_port(server)}", timeout=120) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(10)


def wait_for(predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def install(version: Path, where: Path) -> None:
    """Put a version's files at the served paths, each replaced atomically, as the stages write them."""
    (where / "index").mkdir(parents=True, exist_ok=True)
    for rel in ("index/index.faiss", "index/ids.parquet", "index/index.json", "model.pt"):
        tmp = where / f"{rel}.incoming"
        shutil.copy(version / rel, tmp)
        os.replace(tmp, where / rel)


def local_source(where: Path) -> LocalModelSource:
    return LocalModelSource(where / "model.pt", where / "index", IMAGE_SIZE, name="glyphs")


def clustered(n: int, dim: int = 32, centres: int = 50, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((centres, dim))
    x = c[rng.integers(0, centres, n)] + 0.6 * rng.standard_normal((n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def product_like(n: int, dim: int = 64, seed: int = 0) -> np.ndarray:
    """Clusters of ~200 rows holding classes of ~5 (as benchmarks/serving_bench's catalogue): the nearest
    neighbours are close together, where PQ's quantisation error reorders them."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n // 200, dim))
    classes = centres[rng.integers(0, len(centres), n // 5)] + rng.standard_normal((n // 5, dim))
    x = classes[rng.integers(0, len(classes), n)] + 0.5 * rng.standard_normal((n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


PQ = dict(type="ivf_pq", min_rows_approx=0, nlist=64, nprobe=8, pq_m=8, pq_nbits=8, recall_queries=300)


def exact_top10_found(idx: CatalogueIndex, x: np.ndarray, queries: np.ndarray) -> float:
    """The fraction of queries whose whole exact top-10 the index returns."""
    exact = np.argsort(-(queries @ x.T), axis=1)[:, :10]
    _, rows = idx.search(queries, 10)
    return float(np.mean([set(a) == set(b) for a, b in zip(exact, rows)]))


def write_shard(path, emb: np.ndarray, start: int):
    """A parquet file in the format `xbn embed` writes (path, label, embedding list)."""
    offsets = pa.array(np.arange(len(emb) + 1, dtype=np.int32) * emb.shape[1])
    table = pa.table({
        "path": [f"part/{start + i}.png" for i in range(len(emb))],
        "label": [str((start + i) % 9) for i in range(len(emb))],
        "embedding": pa.ListArray.from_arrays(offsets, pa.array(emb.reshape(-1), pa.float32())),
    }).replace_schema_metadata({b"xbn.embedding_dim": str(emb.shape[1]).encode()})
    pq.write_table(table, path)
    return path
