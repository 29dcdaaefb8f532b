"""Embed a manifest split with a model and score it: the glue between the data, the model and the metrics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch.utils.data import DataLoader

from xbn.data import ImageDataset, build_transform, encode_labels
from xbn.evaluation.metrics import retrieval_metrics


def autocast(device: torch.device, enabled: bool = True):
    # bfloat16 needs no loss scaling; on the CPU autocast would only slow the convolutions down.
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled and device.type == "cuda")


def image_loader(frame: pd.DataFrame, root: str | Path, labels: np.ndarray, transform, batch_size: int,
                 num_workers: int, device: torch.device) -> DataLoader:
    dataset = ImageDataset(frame, root, labels, transform)
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                      pin_memory=device.type == "cuda", persistent_workers=False)


@torch.no_grad()
def embed(model: torch.nn.Module, loader: DataLoader, device: torch.device, amp: bool = True,
          channels_last: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """All embeddings of a loader's images (float32, in dataset order) and their integer labels."""
    was_training = model.training
    model.eval()
    chunks, labels = [], []
    for images, targets, _ in loader:
        images = images.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with autocast(device, amp):
            chunks.append(model(images).float().cpu())
        labels.append(targets)
    model.train(was_training)
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


def evaluate_split(model: torch.nn.Module, manifest: pd.DataFrame, root: str | Path, split: str, *,
                   image_size: int, mean, std, ks, batch_size: int, num_workers: int, device: torch.device,
                   amp: bool = True, channels_last: bool = False, query_chunk: int = 4096, nmi: bool = True,
                   return_embeddings: bool = False):
    """Retrieval metrics of `model` on a split of the manifest (see `retrieval_protocol`)."""
    codes = dict(zip(manifest["label"], encode_labels(manifest["label"])))
    transform = build_transform(image_size, training=False, mean=mean, std=std)
    queries, references = retrieval_protocol(manifest, split)

    def run(frame):
        loader = image_loader(frame, root, frame["label"].map(codes).to_numpy(), transform, batch_size,
                              num_workers, device)
        return embed(model, loader, device, amp, channels_last)

    q_emb, q_lab = run(queries)
    r_emb, r_lab = run(references) if references is not None else (None, None)
    metrics = retrieval_metrics(q_emb, q_lab, r_emb, r_lab, ks=tuple(ks), chunk_size=query_chunk,
                                device=str(device), nmi=nmi)
    if return_embeddings:
        return metrics, (q_emb, q_lab, r_emb, r_lab)
    return metrics
