"""The served embedder: a loaded checkpoint with the eval transform it was trained with, and the one way images
(files, uploaded bytes, manifest rows) become embeddings for everything that serves a model: `xbn embed`,
`xbn search`, `xbn serve`, the MLflow pyfunc (`xbn.tracking.pyfunc`) and the ONNX export. It sits below
tracking and serving so that they all run this code rather than copies of it.

A checkpoint records the backbone's mean/std but not the image size it was trained at (`data.image_size`, or
the `image_size` a registered version records in its pyfunc metadata), so the size is passed in.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import torch
from PIL import Image
from timm.data import DEFAULT_CROP_PCT

from xbn.data import build_transform
from xbn.data.images import UnreadableImage, open_rgb  # noqa: F401 -- UnreadableImage re-exported
from xbn.data.transforms import eval_geometry
from xbn.evaluation.embed import embed, image_loader
from xbn.evaluation.engine import OnnxEngine, engine_for, engined, settled_choice
from xbn.evaluation.inference import (
    FLOAT32,
    Compiled,
    InferenceMode,
    choose_inference_mode,
    fold_batch_norm,
    probe_images,
    resolve_compile,
    run,
    settled,
)
from xbn.models import Embedder, load_embedder
from xbn.utils.io import file_digest

log = logging.getLogger(__name__)


class EmbeddedRows(NamedTuple):
    """Row i of `embeddings` is the frame's row at position `kept[i]`; `skipped` are the unreadable paths."""

    embeddings: np.ndarray
    kept: list[int]
    skipped: list[str]


@dataclass
class ServedModel:
    """An embedder in eval mode and what serving needs around it."""

    model: torch.nn.Module
    transform: Any  # RGB PIL image -> normalised (3, S, S) tensor, as at evaluation
    image_size: int
    embedding_dim: int
    sha256: str  # of the checkpoint file: ties an index to the model that built it
    device: torch.device
    data_config: dict[str, Any]
    mode: InferenceMode = FLOAT32  # memory format and precision (`inference` params; recorded in index.json)
    compile: bool = False  # run `model` through torch.compile (`inference.compile`), once the mode is settled
    # ONNX Runtime on the model's graph (`inference.engine`, `xbn.evaluation.engine`); None: torch only
    engine: OnnxEngine | None = field(default=None, repr=False)
    _compiled: torch.nn.Module | None = field(default=None, repr=False)
    # `xbn serve` embeds each request in a thread of its pool: the first requests must not each build a
    # compiled module (torch.compile then compiles the one that is built once, under its own lock).
    _compile_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _network(self) -> torch.nn.Module:
        """What runs a batch: the compiled model once the mode is final (so it compiles for one precision
        only), else `model`."""
        if not self.compile or not settled(self.mode):
            return self.model
        with self._compile_lock:
            if self._compiled is None:
                log.info("inference: compiling the model with torch.compile (inference.compile); the first "
                         "batch waits 5-15 s for it")
                self._compiled = Compiled(self.model)
            return self._compiled

    @property
    def decode_side(self) -> int:
        """The shorter side a query image is decoded down to at least (`xbn.data.images.decode`): twice the
        side the eval transform resizes to, so its antialiased resize still does the last 2x, and a reduced
        decode embeds as a full one would (cosine > 0.999, tests/serving/test_hostile.py)."""
        return 2 * math.ceil(self.image_size / DEFAULT_CROP_PCT)

    @torch.inference_mode()
    def embed_tensors(self, batch: torch.Tensor) -> np.ndarray:
        """float32 [N, D] unit-norm embeddings of a preprocessed batch."""
        if not len(batch):
            return np.empty((0, self.embedding_dim), dtype=np.float32)
        batch = batch.to(self.device)
        out, self.mode = self._eager_if_compiling_fails(
            lambda network: run(engined(network, self.engine), batch, self.mode, self.device))
        return out.cpu().numpy()

    def record(self) -> dict[str, float]:
        """How it embeds, numbers only (index.json, MLflow): the inference mode's record and the engine's."""
        return {**self.mode.record(), **settled_choice(self.engine).record()}

    def describe(self) -> str:
        return f"{self.mode.describe()}; {settled_choice(self.engine).describe()}"

    def _eager_if_compiling_fails(self, call: Callable[[torch.nn.Module], Any]) -> Any:
        """`call(network)`; if torch.compile fails (no C++ compiler, an op it cannot lower), say why, stop
        compiling and `call` the eager model instead. Any other error is the caller's."""
        from torch._dynamo.exc import TorchDynamoException

        network = self._network()
        try:
            return call(network)
        except TorchDynamoException as exc:
            if network is self.model:
                raise
            log.warning("inference: torch.compile failed (%s: %s); running eager", type(exc).__name__,
                        str(exc).splitlines()[0] if str(exc) else "")
            with self._compile_lock:
                self.compile, self._compiled = False, None
            return call(self.model)

    def pixels(self, image: Image.Image) -> np.ndarray:
        """The uint8 [S, S, 3] pixels `transform` feeds its to-tensor and normalisation steps: `image` resized
        and centre-cropped, what the ONNX graph takes (`xbn.evaluation.onnx_export`)."""
        return np.asarray(eval_geometry(self.transform)(image), dtype=np.uint8)

    def embed_images(self, images: Sequence[Image.Image], batch_size: int = 64) -> np.ndarray:
        """Embeddings of RGB PIL images, in order, `batch_size` at a time (bounds peak memory)."""
        if self.engine is not None:  # the pixels go to ONNX Runtime as they are (`embed_pixels`)
            chunks = [self.embed_pixels(np.stack([self.pixels(im) for im in images[i : i + batch_size]]))
                      for i in range(0, len(images), batch_size)]
        else:
            chunks = [
                self.embed_tensors(torch.stack([self.transform(im) for im in images[i : i + batch_size]]))
                for i in range(0, len(images), batch_size)
            ]
        return np.concatenate(chunks) if chunks else np.empty((0, self.embedding_dim), dtype=np.float32)

    def embed_pixels(self, pixels: np.ndarray) -> np.ndarray:
        """Embeddings of uint8 pixels [N, S, S, 3] (`pixels`): straight to ONNX Runtime once it is the engine,
        else normalised as the transform does and embedded by `embed_tensors` (where auto decides)."""
        if self.engine is not None and self.engine.runs_onnx and len(pixels):
            return self.engine.embed_pixels(pixels)
        normalise = self.engine.tensor if self.engine is not None else self._tensor
        return self.embed_tensors(normalise(pixels))

    def _tensor(self, pixels: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(np.ascontiguousarray(pixels)).permute(0, 3, 1, 2).float().div(255)
        mean = torch.tensor(self.data_config["mean"], dtype=torch.float32).view(1, 3, 1, 1)
        return x.sub_(mean).div_(torch.tensor(self.data_config["std"], dtype=torch.float32).view(1, 3, 1, 1))

    def embed_frame(
        self, frame: pd.DataFrame, root: str | Path, batch_size: int = 64, num_workers: int | str = 0
    ) -> EmbeddedRows:
        """Embeddings of the manifest-format rows of `frame` (paths relative to `root`); unreadable images are
        left out and named (`ImageDataset` logs each with its error)."""
        if frame.empty:
            return EmbeddedRows(np.empty((0, self.embedding_dim), dtype=np.float32), [], [])
        loader = image_loader(
            frame,
            root,
            np.zeros(len(frame), dtype=np.int64),
            self.transform,
            batch_size,
            num_workers,
            self.device,
            skip_unreadable=True,
        )
        kept: list[int] = []

        def embed_all(network: torch.nn.Module) -> tuple[np.ndarray, np.ndarray]:
            kept.clear()  # a second pass (eager, after a failed compile) starts over
            return embed(engined(network, self.engine), loader, self.device, self.mode, kept=kept)

        emb, _ = self._eager_if_compiling_fails(embed_all)
        if not kept:
            emb = np.empty((0, self.embedding_dim), dtype=np.float32)
        kept_set = set(kept)
        return EmbeddedRows(
            emb, kept, [p for i, p in enumerate(frame["path"].astype(str)) if i not in kept_set]
        )


def load_served_model(path: str | Path, image_size: int, device: str | torch.device = "cpu",
                      precision: str = "auto", channels_last: bool | str = "auto", compile: bool | str = "auto",
                      long_running: bool = False, engine: str = "auto",
                      onnx_graph: str | Path | None = None) -> ServedModel:
    """The embedder checkpoint at `path` (as `xbn train` writes models/model.pt), served at `image_size`, in the
    mode and by the engine the `inference` params choose (`xbn.evaluation.inference`, `xbn.evaluation.engine`);
    `onnx_graph`: the registered version's own ONNX graph, sha256-checked (else one is exported and cached)."""
    device = torch.device(device)
    model, data_config, _ = load_embedder(path, map_location=device)
    return served(model, data_config, image_size, file_digest(path), device, precision, channels_last, compile,
                  long_running, engine, onnx_graph)


def served(
    model: Embedder,
    data_config: dict[str, Any],
    image_size: int,
    sha256: str = "",
    device: str | torch.device = "cpu",
    precision: str = "auto",
    channels_last: bool | str = "auto",
    compile: bool | str = "auto",
    long_running: bool = False,
    engine: str = "auto",
    onnx_graph: str | Path | None = None,
) -> ServedModel:
    """Wrap an in-memory embedder (e.g. the one `xbn register` just evaluated) for serving: a copy with its
    BatchNorms folded into the convolutions (`fold_batch_norm`; `model` itself is left as it was), in the mode
    the `inference` params choose. `long_running`: the process serves for a while (`xbn serve`), so
    `compile: auto` compiles. `engine`: `inference.engine` (`xbn.evaluation.engine.engine_for`)."""
    transform = build_transform(image_size, training=False, mean=data_config["mean"], std=data_config["std"])
    device = torch.device(device)
    model = fold_batch_norm(model.eval(), probe_images(1, image_size, device))
    if engine == "onnxruntime":  # torch runs only batches that are not pixels: no probe for its mode
        mode = replace(FLOAT32, chosen_by="inference.engine: onnxruntime")
    else:
        mode = choose_inference_mode(model, device, image_size, precision, channels_last)
    result = ServedModel(
        mode.prepare(model),
        transform,
        int(image_size),
        int(model.embedding_dim),
        sha256,
        device,
        dict(data_config),
        mode,
        resolve_compile(compile, long_running),
    )
    result.engine = engine_for(result, engine, onnx_graph)
    return result


def model_engine(model: Embedder, data_config: dict[str, Any], image_size: int, sha256: str,
                 device: str | torch.device, engine: str = "auto") -> OnnxEngine | None:
    """The `inference.engine` of an embedder a stage runs itself (`xbn evaluate`): `engine_for` on `model` as
    served, None for torch; `xbn.evaluation.engine.engined(model, it)` is what then embeds."""
    transform = build_transform(image_size, training=False, mean=data_config["mean"], std=data_config["std"])
    view = ServedModel(model, transform, int(image_size), int(model.embedding_dim), sha256, torch.device(device),
                       dict(data_config))
    return engine_for(view, engine)


def open_image(path: str | Path, min_side: int | None = None) -> Image.Image:
    """An image file as RGB, or `UnreadableImage` naming it (missing, not an image, truncated, malformed).
    `min_side`: decode at reduced size (`ServedModel.decode_side`), as the server does with an upload."""
    return open_rgb(path, min_side=min_side)


def decode_image(
    data: bytes,
    name: str = "upload",
    max_pixels: int | None = None,
    formats: Collection[str] | None = None,
    min_side: int | None = None,
) -> Image.Image:
    """Uploaded bytes as an RGB image, or `UnreadableImage` saying what is wrong with them. `max_pixels` is
    checked on the header, before any pixel is decoded (a few kB of PNG can decode to gigabytes)."""
    return open_rgb(data, name, formats=formats, max_pixels=max_pixels, min_side=min_side)
