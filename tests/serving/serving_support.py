"""Helpers of the serving tests, importable by name (a `conftest` import is ambiguous across folders)."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import httpx
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
        with httpx.Client(base_url=f"http://127.0.0.1:{bound_port(server)}", timeout=30) as client:
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
