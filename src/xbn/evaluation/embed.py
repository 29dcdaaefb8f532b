"""Embed a manifest split with a model and score it: the glue between the data, the model and the metrics."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import torch
from torch.utils.data import DataLoader

from xbn.data import ImageDataset, build_transform, encode_labels
from xbn.data.dataset import collate_skipping, loader_worker_init
from xbn.data.loading import loader_options, resolve_num_workers
from xbn.evaluation.inference import FLOAT32, InferenceMode, run
from xbn.evaluation.metrics import retrieval_metrics
from xbn.utils.progress import bar

log = logging.getLogger(__name__)


def autocast(device: torch.device, enabled: bool = True):
    """bfloat16 autocast (no loss scaling needed) when `enabled`, on any device: callers decide where it pays
    (training: `train.amp` on CUDA only; inference: `xbn.evaluation.inference`)."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


def image_loader(frame: pd.DataFrame, root: str | Path, labels: np.ndarray, transform, batch_size: int,
                 num_workers: int | str, device: torch.device, skip_unreadable: bool = False) -> DataLoader:
    """`skip_unreadable`: unreadable images are left out of their batch (see `embed`'s `kept`). `num_workers`:
    a number or `auto` (`xbn.data.loading.resolve_num_workers`); one pass, so the workers do not persist."""
    dataset = ImageDataset(frame, root, labels, transform, skip_unreadable=skip_unreadable)
    return DataLoader(dataset, batch_size=batch_size, shuffle=False,
                      collate_fn=collate_skipping if skip_unreadable else None, worker_init_fn=loader_worker_init,
                      **loader_options(resolve_num_workers(num_workers), device.type, persistent=False,
                                       queued_batches=None))


@torch.no_grad()
def embed(model: torch.nn.Module, loader: DataLoader, device: torch.device, mode: InferenceMode = FLOAT32,
          kept: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """All embeddings of a loader's images (float32, in dataset order) and their integer labels, computed in
    `mode` (memory format, precision: `xbn.evaluation.inference`; the model already prepared for it); `kept`,
    if given, receives the dataset indices embedded (fewer than the dataset's when images were skipped)."""
    was_training = model.training
    model.eval()
    chunks, labels = [], []
    for images, targets, indices in bar(loader, "embed", unit="batch"):
        if kept is not None:
            kept.extend(int(i) for i in indices)
        if not len(targets):  # every image of the batch was skipped
            continue
        out, mode = run(model, images.to(device, non_blocking=True), mode, device)
        chunks.append(out.cpu())
        labels.append(targets)
    model.train(was_training)
    if not chunks:  # every image unreadable (skipped): nothing to concatenate; the caller knows the width
        return np.empty((0, 0), dtype=np.float32), np.empty(0, dtype=np.int64)
    return torch.cat(chunks).numpy(), torch.cat(labels).numpy()


def retrieval_protocol(manifest: pd.DataFrame, split: str) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """(queries, references): query -> gallery where the dataset has them (In-Shop, DeepFashion2), else
    leave-one-out within the split (CUB, CARS, SOP, validation)."""
    if split == "test" and {"query", "gallery"} <= set(manifest["split"]):
        return manifest[manifest["split"] == "query"], manifest[manifest["split"] == "gallery"]
    frame = manifest[manifest["split"] == split]
    if frame.empty:
        raise ValueError(f"the manifest has no '{split}' rows to evaluate on")
    return frame, None


class ProtocolEmbeddings(NamedTuple):
    """A split embedded for its retrieval protocol: queries (and references, None for leave-one-out), the
    manifest paths of the queries embedded (row i of `query_emb` is `query_paths[i]`), and the images left out
    because they could not be read."""

    query_emb: np.ndarray
    query_labels: np.ndarray
    reference_emb: np.ndarray | None
    reference_labels: np.ndarray | None
    query_paths: list[str]
    skipped: list[str]


def embed_protocol(model: torch.nn.Module, manifest: pd.DataFrame, root: str | Path, split: str, *,
                   image_size: int, mean, std, batch_size: int, num_workers: int | str, device: torch.device,
                   mode: InferenceMode = FLOAT32) -> ProtocolEmbeddings:
    """Embed the queries and references of a split of the manifest (see `retrieval_protocol`)."""
    codes = dict(zip(manifest["label"], encode_labels(manifest["label"])))
    transform = build_transform(image_size, training=False, mean=mean, std=std)
    queries, references = retrieval_protocol(manifest, split)

    skipped: list[str] = []
    query_paths: list[str] = []

    def run(frame, paths: list[str] | None = None):
        # An image that became unreadable after `validate` is left out and named, not fatal.
        loader = image_loader(frame, root, frame["label"].map(codes).to_numpy(), transform, batch_size,
                              num_workers, device, skip_unreadable=True)
        kept: list[int] = []
        result = embed(model, loader, device, mode, kept=kept)
        lost = sorted(set(range(len(frame))) - set(kept))
        if paths is not None:
            paths.extend(frame["path"].iloc[sorted(kept)].astype(str))
        if lost:
            skipped.extend(frame["path"].iloc[lost].tolist())
            log.warning("%s split: %d unreadable image(s) left out: %s", split, len(lost),
                        ", ".join(frame["path"].iloc[lost]))
        return result

    q_emb, q_lab = run(queries, query_paths)
    r_emb, r_lab = run(references) if references is not None else (None, None)
    return ProtocolEmbeddings(q_emb, q_lab, r_emb, r_lab, query_paths, skipped)


def evaluate_split(model: torch.nn.Module, manifest: pd.DataFrame, root: str | Path, split: str, *,
                   image_size: int, mean, std, ks, batch_size: int, num_workers: int | str, device: torch.device,
                   mode: InferenceMode = FLOAT32, query_chunk: int = 4096, nmi: bool = True,
                   return_embeddings: bool = False):
    """Retrieval metrics of `model` on a split of the manifest (see `retrieval_protocol`)."""
    e = embed_protocol(model, manifest, root, split, image_size=image_size, mean=mean, std=std,
                       batch_size=batch_size, num_workers=num_workers, device=device, mode=mode)
    metrics: dict[str, Any] = retrieval_metrics(  # the skipped images' names join the numbers
        e.query_emb, e.query_labels, e.reference_emb, e.reference_labels, ks=tuple(ks),
        chunk_size=query_chunk, device=str(device), nmi=nmi)
    # Counted (the `num_` prefix keeps it out of the quality scores) and named, for eval.json.
    metrics["num_skipped_images"] = len(e.skipped)
    metrics["skipped_images"] = e.skipped
    if return_embeddings:
        return metrics, (e.query_emb, e.query_labels, e.reference_emb, e.reference_labels)
    return metrics


def embed_split(model: torch.nn.Module, manifest: pd.DataFrame, root: str | Path, split: str, *, image_size: int,
                mean, std, batch_size: int, num_workers: int | str, device: torch.device,
                mode: InferenceMode = FLOAT32) -> tuple[np.ndarray, np.ndarray]:
    """Embeddings and integer labels of one split's rows, in manifest order (e.g. `train` for the
    embedding-space metrics of `embedding_space.py`)."""
    frame = manifest[manifest["split"] == split]
    if frame.empty:
        raise ValueError(f"the manifest has no '{split}' rows to embed")
    codes = dict(zip(manifest["label"], encode_labels(manifest["label"])))
    transform = build_transform(image_size, training=False, mean=mean, std=std)
    # The rows only feed statistics: an image unreadable since `validate` is left out (and logged).
    loader = image_loader(frame, root, frame["label"].map(codes).to_numpy(), transform, batch_size, num_workers,
                          device, skip_unreadable=True)
    return embed(model, loader, device, mode)
