"""Builders for the tracking tests: tiny real models (timm's `test_resnet`), eval results, manifests, and a
pipeline execution as `dvc repro` runs it around the registry."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from xbn.config import Params
from xbn.models import Embedder, build_embedder, save_embedder
from xbn.stages.register import register
from xbn.tracking import pipeline_run

METRICS = {"recall@1": 0.50, "recall@2": 0.60, "recall@10": 0.80, "map@r": 0.30, "r_precision": 0.35,
           "nmi": 0.60}


def write_manifest(path: Path, version: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"path,label,split\n{version}/a.png,1,test\n{version}/b.png,1,test\n")


def write_model(params: Params, seed: int) -> Embedder:
    """A tiny real embedder (different weights per seed) saved as models/model.pt; returned in eval mode."""
    torch.manual_seed(seed)
    embedder, data_config = build_embedder(params.model)
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


def run_pipeline(params: Params, seed: int, **metric_changes: float) -> dict:
    """What `dvc repro` does around the registry: train (starts the run), evaluate, register (joins it)."""
    write_model(params, seed)
    write_eval(params, **metric_changes)
    with pipeline_run(params, "train", new=True):
        pass
    return register(params)
