"""The served embedder as ONNX: backbone, head and L2 normalisation in one graph, batch size free.

Exported with torch's `torch.export`-based exporter (the default since torch 2.9; the TorchScript one is
deprecated) at opset 18, which onnxruntime 1.32 runs. Height and width stay fixed at the size the model is
served at: the transform crops every image to it. The file carries what a serving stack needs to feed it
(image size, mean, std) and the checkpoint's sha256 as ONNX metadata, and `check_parity` compares it with
torch on real images before it is trusted.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from xbn.evaluation.inference import FLOAT32
from xbn.serving.model import ServedModel, open_image
from xbn.utils.io import atomic_path

log = logging.getLogger(__name__)

OPSET = 18
INPUT, OUTPUT = "images", "embeddings"
PARITY_ATOL = 1e-4


class ParityError(AssertionError):
    """The ONNX graph and the torch model disagree beyond the tolerance."""


def export_onnx(model: ServedModel, path: str | Path, opset: int = OPSET) -> Path:
    """Write `model` as a single ONNX file at `path` (atomically) with a dynamic batch axis."""
    import onnx

    # The served copy may sit on a GPU or in channels_last: the graph is exported from an NCHW copy on the CPU.
    module = copy.deepcopy(model.model).cpu().eval().to(memory_format=torch.contiguous_format)
    size = model.image_size
    # Batch 2, not 1: torch.export specialises a dimension of size 1 to a constant.
    example = torch.zeros(2, 3, size, size)
    path = Path(path)
    with atomic_path(path) as tmp:
        torch.onnx.export(
            module,
            (example,),
            str(tmp),
            input_names=[INPUT],
            output_names=[OUTPUT],
            dynamic_shapes=({0: torch.export.Dim("batch")},),
            opset_version=opset,
            external_data=False,
            dynamo=True,
            verbose=False,
        )
        proto = onnx.load(str(tmp))
        metadata = {
            "image_size": size,
            "mean": list(model.data_config["mean"]),
            "std": list(model.data_config["std"]),
            "embedding_dim": model.embedding_dim,
            "model_sha256": model.sha256,
            "producer": "xbn",
        }
        onnx.helper.set_model_props(proto, {k: json.dumps(v) for k, v in metadata.items()})
        onnx.checker.check_model(proto)
        onnx.save(proto, str(tmp))
    log.info("ONNX (opset %d, batch dynamic, %dx%d input) -> %s", opset, size, size, path)
    return path


def onnx_metadata(path: str | Path) -> dict:
    """The metadata `export_onnx` wrote into the file (image_size, mean, std, embedding_dim, model_sha256)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return {p.key: json.loads(p.value) for p in proto.metadata_props}


def onnx_embed(path: str | Path, batch: np.ndarray):
    """Embeddings of a preprocessed float32 batch [N, 3, S, S] by onnxruntime on the CPU."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run([OUTPUT], {INPUT: np.ascontiguousarray(batch, dtype=np.float32)})[0]


def check_parity(
    model: ServedModel, path: str | Path, image_paths: Sequence[str | Path], atol: float = PARITY_ATOL
) -> float:
    """Embed real images with torch and with the ONNX file (one batch, so the dynamic axis is exercised with
    their count); returns the max |difference|, raising `ParityError` above `atol`."""
    if not image_paths:
        raise ValueError("parity needs at least one image")
    batch = torch.stack([model.transform(open_image(p)) for p in image_paths])
    expected = dataclasses.replace(model, mode=FLOAT32).embed_tensors(batch)  # the graph is float32
    got = onnx_embed(path, batch.numpy())
    diff = float(np.abs(got - expected).max())
    log.info("ONNX parity on %d image(s): max |diff| %.2e (tolerance %.0e)", len(image_paths), diff, atol)
    if not diff <= atol:
        raise ParityError(
            f"{path}: ONNX embeddings differ from torch by up to {diff:.3e} (> {atol:.0e}) on "
            f"{len(image_paths)} image(s)"
        )
    return diff
