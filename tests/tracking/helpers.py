"""Builders for the tracking tests: tiny real models (timm's `test_resnet`), eval results, manifests with real
images, and a pipeline execution as `dvc repro` runs it around the registry.

The gate embeds the `val` rows with each model, so the images are real: 8 classes of 4 solid-colour images.
A random-init model retrieves them perfectly (R@1 = 1 on every query); a `blind` model (its head's weights
zeroed, so every image gets the same embedding) retrieves by tie order, about never (R@1 near 0). That gives
the gate known outcomes: blind -> seeing is a clear improvement, seeing -> seeing a tie."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from mlflow.tracking import MlflowClient
from PIL import Image

from xbn.config import Params
from xbn.models import Embedder, build_embedder, save_embedder
from xbn.stages.register import register
from xbn.tracking import Registry, pipeline_run
from xbn.tracking.history import read_history

METRICS = {"recall@1": 0.50, "recall@2": 0.60, "recall@10": 0.80, "map@r": 0.30, "r_precision": 0.35,
           "nmi": 0.60}


VAL_CLASSES, PER_CLASS = 8, 4
VAL_QUERIES = VAL_CLASSES * PER_CLASS


def write_manifest(path: Path, version: str, val: bool = True) -> None:
    """The manifest at `path` and its images under `<path's folder>/images/<version>/` (params' `data.root` is
    `data/images`): `VAL_CLASSES` classes of `PER_CLASS` solid-colour images as `val` rows (left out with
    `val=False`), and two `test` rows. Another `version` is other data (another data hash)."""
    root = path.parent / "images"
    rng = np.random.default_rng(sum(map(ord, version)))
    rows = ["path,label,split"]
    for c in range(VAL_CLASSES + 1):
        colour = rng.integers(0, 256, 3)
        for i in range(PER_CLASS if c < VAL_CLASSES else 2):
            name = f"{version}/c{c}_{i}.png"
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            pixels = np.clip(colour + rng.normal(0, 8, (32, 32, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / name)
            if c < VAL_CLASSES and val:
                rows.append(f"{name},{c},val")
            elif c == VAL_CLASSES:
                rows.append(f"{name},test,test")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n")


def write_model(params: Params, seed: int, blind: bool = False) -> Embedder:
    """A tiny real embedder (different weights per seed) saved as models/model.pt; returned in eval mode.
    `blind`: its head's weights are zero, so it gives every image the same embedding (its bias)."""
    torch.manual_seed(seed)
    embedder, data_config = build_embedder(params.model)
    if blind:
        with torch.no_grad():
            embedder.head.weight.zero_()
    save_embedder(Path(params.train.checkpoint_dir) / "model.pt", embedder, params.model, data_config,
                  {"epoch": seed})
    return embedder.eval()


def write_eval(params: Params, **changes: float) -> dict:
    metrics = {**METRICS, **changes}
    path = Path(params.eval.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**metrics, "epoch": 3, "num_queries": 40, "num_references": 40,
                                "queries_without_match": 0, "untrained": {"recall@1": 0.1, "nmi": 0.2}}))
    return metrics


def run_pipeline(params: Params, seed: int, blind: bool = False, **metric_changes: float) -> dict:
    """What `dvc repro` does around the registry: train (starts the run), evaluate, register (joins it)."""
    write_model(params, seed, blind)
    write_eval(params, **metric_changes)
    with pipeline_run(params, "train", new=True):
        pass
    return register(params)


def write_images(folder: Path) -> list[Path]:
    """Real files of each kind a client sends: PNG (RGB, grey, RGBA with a transparent half), JPEG, WebP, of
    sizes and aspect ratios other than the model's."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (45, 61, 3), dtype=np.uint8)
    rgba = np.dstack([pixels, np.full((45, 61), 255, np.uint8)])
    rgba[:, :30, 3] = 0  # transparent: composited on white, not the black stored under it
    rgba[:, :30, :3] = 0
    files = {
        "rgb.png": Image.fromarray(pixels),
        "grey.png": Image.fromarray(pixels[..., 0]),
        "alpha.png": Image.fromarray(rgba, "RGBA"),
        "photo.jpg": Image.fromarray(rng.integers(0, 256, (80, 50, 3), dtype=np.uint8)),
        "tall.webp": Image.fromarray(rng.integers(0, 256, (120, 33, 3), dtype=np.uint8)),
    }
    for name, image in files.items():
        image.save(folder / name)
    return [folder / name for name in files]


def next_model(params, seed: int) -> None:
    write_model(params, seed)
    write_eval(params)
    with pipeline_run(params, "train", new=True):
        pass


def state(params) -> dict:
    registry = Registry(params)
    client = MlflowClient(params.tracking.uri)
    found = {int(v.version): client.get_model_version(v.name, v.version).tags
             for v in client.search_model_versions(f"name = '{params.registry.model_name}'")}
    champion, challenger = registry.by_alias("champion"), registry.by_alias("challenger")
    return {"versions": found, "champion": champion and champion.version,
            "challenger": challenger and challenger.version,
            "history": [(e.action, e.from_version, e.to_version) for e in read_history(registry)],
            "descriptions": {v: bool(registry.get(v).description) for v in found}}
