"""The served embedder as ONNX: the input's scaling and normalisation, backbone, head and L2 normalisation in
one graph, batch size free.

The graph takes the RGB pixels of the model's eval transform before its arithmetic: uint8 [N, S, S, 3] (NHWC),
the image already decoded, resized and centre-cropped to S (`ServedModel.pixels`); it divides by 255 and
normalises with the checkpoint's mean and std itself, as the transform's to-tensor and normalise steps do. So a
client in any language needs only to decode, resize and crop: `export_onnx` writes that rule next to the file
as JSON (`<file>.json`, `preprocessing_rule`), read from the transform's own settings.

Exported with torch's `torch.export`-based exporter (the default since torch 2.9; the TorchScript one is
deprecated) at opset 18, which onnxruntime 1.32 runs. The file also carries the image size, mean, std and the
checkpoint's sha256 as ONNX metadata, and `check_parity` compares it with torch on real images before it is
trusted.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from xbn.data.images import BACKGROUND, open_rgb
from xbn.data.transforms import eval_resize_rule
from xbn.evaluation.inference import FLOAT32
from xbn.utils.io import atomic_path, file_digest, write_json

if TYPE_CHECKING:  # served imports the engine, which exports through this module: for annotations only
    from xbn.evaluation.served import ServedModel

log = logging.getLogger(__name__)

OPSET = 18
INPUT, OUTPUT = "images", "embeddings"
PARITY_ATOL = 1e-4


class ParityError(AssertionError):
    """The ONNX graph and the torch model disagree beyond the tolerance."""


class FromPixels(torch.nn.Module):
    """The embedder behind its transform's last two steps: uint8 RGB pixels [N, S, S, 3] -> to-tensor (x / 255,
    CHW) -> normalise ((x - mean) / std) -> embeddings; the same operations, in the same order, as
    torchvision's ToTensor and Normalize."""

    mean: torch.Tensor  # buffers
    std: torch.Tensor

    def __init__(self, model: torch.nn.Module, mean, std) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        images = pixels.permute(0, 3, 1, 2).to(torch.float32).div(255)
        return self.model(images.sub(self.mean).div(self.std))


def rule_path(path: str | Path) -> Path:
    """Where `export_onnx` writes the preprocessing rule of the ONNX file at `path`: `<file>.json`."""
    path = Path(path)
    return path.with_name(path.name + ".json")


def export_onnx(model: ServedModel, path: str | Path, opset: int = OPSET) -> Path:
    """Write `model` as a single ONNX file at `path` with a dynamic batch axis, then its preprocessing rule at
    `rule_path(path)` (each atomically)."""
    import onnx

    # The served copy may sit on a GPU or in channels_last: the graph is exported from an NCHW copy on the CPU.
    module = copy.deepcopy(model.model).cpu().eval().to(memory_format=torch.contiguous_format)
    module = FromPixels(module, model.data_config["mean"], model.data_config["std"]).eval()
    size = model.image_size
    # Batch 2, not 1: torch.export specialises a dimension of size 1 to a constant.
    example = torch.zeros(2, size, size, 3, dtype=torch.uint8)
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
            "input": "uint8 NHWC RGB, resized and centre-cropped: see the .json beside the file",
            "producer": "xbn",
        }
        onnx.helper.set_model_props(proto, {k: json.dumps(v) for k, v in metadata.items()})
        onnx.checker.check_model(proto)
        onnx.save(proto, str(tmp))
    write_json(rule_path(path), preprocessing_rule(model, path))
    log.info("ONNX (opset %d, batch dynamic, uint8 %dx%dx3 input) -> %s (+ %s)", opset, size, size, path,
             rule_path(path).name)
    return path


def preprocessing_rule(model: ServedModel, path: str | Path) -> dict:
    """What a client does to an image file before the ONNX file at `path` takes it, and what the graph does
    after: the steps of `model.transform` (`xbn.data.transforms.eval_resize_rule`) and of the decoding
    `xbn embed` runs (`xbn.data.images.open_rgb`)."""
    size = model.image_size
    return {
        "onnx_file": Path(path).name,
        "onnx_sha256": file_digest(path),
        "model_sha256": model.sha256,
        "input": {"name": INPUT, "dtype": "uint8", "shape": ["N", size, size, 3], "layout": "NHWC",
                  "channels": "RGB"},
        "decode": {
            "color": "RGB (grey and palette images expanded as PIL's convert('RGB') does)",
            "transparency": "composited over an opaque background (PIL Image.alpha_composite)",
            "background": list(BACKGROUND),
            "exif_orientation": "not applied: the pixels as stored",
        },
        **eval_resize_rule(model.transform),  # resize, then center_crop, to size x size
        "in_graph": {
            "steps": "x = pixels / 255 (float32, to NCHW); x = (x - mean) / std per channel",
            "mean": [float(v) for v in model.data_config["mean"]],
            "std": [float(v) for v in model.data_config["std"]],
        },
        "output": {"name": OUTPUT, "dtype": "float32", "shape": ["N", model.embedding_dim],
                   "l2_normalized": True},
    }


def onnx_metadata(path: str | Path) -> dict:
    """The metadata `export_onnx` wrote into the file (image_size, mean, std, embedding_dim, model_sha256)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return {p.key: json.loads(p.value) for p in proto.metadata_props}


def save_mlflow_onnx(path: str | Path, target: str | Path) -> Path:
    """The ONNX file at `path` as an MLflow `onnx` model folder at `target`, with the graph's own signature (uint8
    pixels [N, S, S, 3] in, the embeddings out): what `mlflow.onnx.load_model`, `mlflow.pyfunc` (onnxruntime),
    Triton and KServe load, the normalisation being inside the graph."""
    import mlflow.onnx
    import onnx
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    proto = onnx.load(str(path))

    def spec(value) -> TensorSpec:
        tensor = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim]
        return TensorSpec(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type), shape, value.name)

    signature = ModelSignature(Schema([spec(v) for v in proto.graph.input]),
                               Schema([spec(v) for v in proto.graph.output]))
    mlflow.onnx.save_model(proto, str(target), signature=signature,
                           metadata={k: v for k, v in onnx_metadata(path).items()})
    return Path(target)


def onnx_embed(path: str | Path, pixels: np.ndarray):
    """Embeddings of uint8 pixels [N, S, S, 3] (`ServedModel.pixels`) by onnxruntime on the CPU."""
    import onnxruntime as ort

    pixels = np.asarray(pixels)
    if pixels.dtype != np.uint8:
        raise ValueError(f"the ONNX graph takes uint8 pixels [N, S, S, 3], got {pixels.dtype}")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run([OUTPUT], {INPUT: np.ascontiguousarray(pixels)})[0]


def check_parity(
    model: ServedModel, path: str | Path, image_paths: Sequence[str | Path], atol: float = PARITY_ATOL
) -> float:
    """Embed real images with torch (the whole transform) and with the ONNX file (their resized pixels; one
    batch, so the dynamic axis is exercised with their count); returns the max |difference|, raising
    `ParityError` above `atol`."""
    if not image_paths:
        raise ValueError("parity needs at least one image")
    images = [open_rgb(p) for p in image_paths]
    # torch in float32 (the graph is float32), whatever engine `model` itself runs
    expected = dataclasses.replace(model, mode=FLOAT32, engine=None).embed_images(images)
    got = onnx_embed(path, np.stack([model.pixels(image) for image in images]))
    diff = float(np.abs(got - expected).max())
    log.info("ONNX parity on %d image(s): max |diff| %.2e (tolerance %.0e)", len(image_paths), diff, atol)
    if not diff <= atol:
        raise ParityError(
            f"{path}: ONNX embeddings differ from torch by up to {diff:.3e} (> {atol:.0e}) on "
            f"{len(image_paths)} image(s)"
        )
    return diff
