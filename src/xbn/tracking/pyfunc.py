"""The trained embedder as an MLflow pyfunc: `mlflow.pyfunc.load_model(uri).predict(batch)` gives embeddings.

The model ships only the `models/model.pt` checkpoint as an artifact and rebuilds the network with
`xbn.models.load_embedder`, so xbn must be installed where it is loaded (it is, wherever this project runs);
torch and timm are imported only when the model is loaded, not when this module is. It is logged as a model
from code (`_pyfunc_model.py`), so nothing is pickled.
"""

from __future__ import annotations

import logging
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np
from mlflow.models import ModelSignature
from mlflow.types import Schema, TensorSpec

CHECKPOINT_ARTIFACT = "checkpoint"
# The checkpoint's sha256 at logging time, in the model's `model_config`: load_context refuses other bytes.
CHECKPOINT_SHA256 = "checkpoint_sha256"
# Logged as a "model from code" (MLflow's recommended form): this file defines the model by importing xbn.
MODEL_CODE = Path(__file__).with_name("_pyfunc_model.py")
REGISTERED_MODEL_META = "registered_model_meta"  # mlflow.store.artifact.models_artifact_repo writes it
_REQUIREMENTS = ("torch", "torchvision", "timm", "numpy", "pillow", "pydantic", "mlflow")


class EmbedderModel(mlflow.pyfunc.PythonModel):
    """predict: float32 images [N, 3, H, W], already normalized with the model's mean/std (see the model's
    metadata) -> L2-normalized float32 embeddings [N, D]."""

    batch_size = 256  # bounds peak memory on large inputs; outputs do not depend on it

    def load_context(self, context) -> None:
        import torch

        from xbn.models import load_embedder
        from xbn.utils.integrity import verify_file

        checkpoint = context.artifacts[CHECKPOINT_ARTIFACT]
        # Verified before torch.load sees a byte of it: first against the registered version's tag (kept in the
        # tracking store, which the artifact store cannot alter), then against the MLmodel's own record.
        registered = _registered_version(Path(checkpoint).parents[1])
        if registered is not None:
            name, version, expected = registered
            verify_file(checkpoint, expected, what=f"the checkpoint of {name} v{version}")
        if expected := (context.model_config or {}).get(CHECKPOINT_SHA256):
            verify_file(checkpoint, expected, what="checkpoint", recorded="is recorded in its MLmodel")
        elif registered is None:  # logged before hashes were recorded
            logging.getLogger(__name__).warning("%s: no recorded sha256, loading it unverified", checkpoint)
        self._torch = torch
        self._device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self._model, self.data_config, _ = load_embedder(checkpoint, map_location=self._device, verify=False)

    def predict(self, context, model_input: np.ndarray, params: dict[str, Any] | None = None) -> np.ndarray:
        torch = self._torch
        images = np.asarray(model_input, dtype=np.float32)
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"expected a float32 image batch [N, 3, H, W], got shape {images.shape}")
        chunks = []
        with torch.inference_mode():
            for start in range(0, len(images), self.batch_size):
                batch = torch.from_numpy(images[start : start + self.batch_size]).to(self._device)
                chunks.append(self._model(batch).float().cpu().numpy())
        dim = self._model.embedding_dim
        return np.concatenate(chunks) if chunks else np.empty((0, dim), dtype=np.float32)


def _registered_version(model_dir: Path) -> tuple[str, str, str] | None:
    """(name, version, its `model_sha256` tag) when the model at `model_dir` was loaded as a registered version
    (`models:/name/1`, `models:/name@champion`): MLflow's loader writes the version it resolved into
    `registered_model_meta` on download, and the tag is read from the registry it downloaded from. None for a
    load by run or path, or a version registered without the tag."""
    meta = model_dir / REGISTERED_MODEL_META
    if not meta.is_file():
        return None
    import yaml
    from mlflow.tracking import MlflowClient

    from xbn.tracking.registry import SHA_TAG

    found = yaml.safe_load(meta.read_text()) or {}
    name, version = str(found.get("model_name", "")), str(found.get("model_version", ""))
    if not name or not version.isdigit():  # a logged (unregistered) model's meta says version 'None'
        return None
    expected = MlflowClient().get_model_version(name, version).tags.get(SHA_TAG)
    return (name, version, expected) if expected else None


def signature(embedding_dim: int) -> ModelSignature:
    # Height and width stay free: the backbone pools globally, so any image size embeds. The tensors are
    # unnamed so that predict receives the array itself rather than a {name: array} dict.
    return ModelSignature(
        inputs=Schema([TensorSpec(np.dtype(np.float32), (-1, 3, -1, -1))]),
        outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, embedding_dim))]),
    )


def input_example(image_size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 3, image_size, image_size), dtype=np.float32)


def pip_requirements() -> list[str]:
    """The installed versions of what the model needs. Given explicitly because MLflow would otherwise infer
    them by loading the model in a subprocess (slow). xbn itself is not on PyPI and is left out."""
    pins = []
    for name in _REQUIREMENTS:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pins.append(name)
    return pins
