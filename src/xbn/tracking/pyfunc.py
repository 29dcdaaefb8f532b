"""The trained embedder as an MLflow pyfunc: images in, L2-normalized embeddings out.

`mlflow.pyfunc.load_model(uri).predict(frame)` takes a DataFrame with a binary column `image` (the encoded
bytes of a JPEG, PNG, WebP, ... file; MLflow's JSON transport, `mlflow models serve`, carries them as base64) or
a string column `path` (a file on a filesystem the model can read; off unless the model is loaded with
`model_config={"path_root": ...}`, see below), one image per row, and answers a DataFrame with the same rows:
`embedding` (a list of floats, None for a row that failed) and `error` (None, or a message naming the row).
A bad row never fails the others (but over HTTP, MLflow decodes the base64 of the whole column before the model
sees it: a request mixing rows with `image` and rows without it is refused by MLflow; send such rows in separate
requests). The images are decoded, composited, resized and normalised by
`xbn.evaluation.served`, the code `xbn embed` runs, in the inference mode `xbn embed` chooses.

Callers that already preprocess (float32 [N, 3, S, S], normalised with the model's mean/std) use the second
method: `load_model(uri).unwrap_python_model().embed_tensors(batch)`. A version logged before the image
signature (a tensor signature) still predicts on such a batch.

`model_config` (recorded at logging time from params; `load_model(uri, model_config={...})`, or the
`SERVING_MODEL_CONFIG` environment variable of `mlflow models serve`, overrides a key): `image_size`,
`precision`, `channels_last` and `engine` (`inference` params; ONNX Runtime's graph is exported on load and
cached, `xbn.evaluation.engine`), `max_pixels` and `allowed_formats` (`serve` params:
what a decoded upload may be), `path_root` (the folder `path` rows are read under; None: the `path` column
is refused, so that a served endpoint does not read whatever file a client names).

The model ships the `models/model.pt` checkpoint as an artifact and xbn's own code (`code_paths`: the installed
package, copied), and rebuilds the network with `xbn.models.load_embedder`, so it loads wherever its pip
requirements are installed, xbn or not (`mlflow models serve`, build-docker, KServe, MLServer); torch and timm
are imported only when the model is loaded, not when this module is. It is logged as a model from code
(`_pyfunc_model.py`), so nothing is pickled.
"""

from __future__ import annotations

import io
import logging
import math
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from mlflow.models import ModelSignature
from mlflow.pyfunc.model import PythonModel  # where it is defined: mlflow.pyfunc does not re-export it
from mlflow.types import ColSpec, DataType, Schema
from mlflow.types.schema import Array

from xbn.data.images import open_rgb
from xbn.utils.integrity import verify_file

CHECKPOINT_ARTIFACT = "checkpoint"
SHA_TAG = "model_sha256"  # the registered version's tag holding the checkpoint's sha256 (`xbn.tracking.registry`)
# The checkpoint's sha256 at logging time, in the model's `model_config`: load_context refuses other bytes.
CHECKPOINT_SHA256 = "checkpoint_sha256"
# Logged as a "model from code" (MLflow's recommended form): this file defines the model by importing xbn.
MODEL_CODE = Path(__file__).with_name("_pyfunc_model.py")
REGISTERED_MODEL_META = "registered_model_meta"  # mlflow.store.artifact.models_artifact_repo writes it
# What loading the model imports (xbn's code travels with it: `package_code`); faiss, scipy, pyarrow and tqdm
# because the modules on the way import them at the top.
_REQUIREMENTS = ("torch", "torchvision", "timm", "numpy", "pandas", "pillow", "pydantic", "pyyaml", "mlflow",
                 "faiss-cpu", "scipy", "pyarrow", "tqdm", "filelock",
                 "onnxruntime", "onnx", "onnxscript")  # `inference.engine` (auto falls back to torch without them)

IMAGE, PATH = "image", "path"  # input columns
EMBEDDING, ERROR = "embedding", "error"  # output columns
# model_config keys besides CHECKPOINT_SHA256 (see the module docstring)
IMAGE_SIZE, PRECISION, CHANNELS_LAST, ENGINE = "image_size", "precision", "channels_last", "engine"
MAX_PIXELS, ALLOWED_FORMATS, PATH_ROOT = "max_pixels", "allowed_formats", "path_root"


class RowError(ValueError):
    """What is wrong with one input row (`embed_rows` prefixes the row's name)."""


class EmbedderModel(PythonModel):
    """See the module docstring."""

    batch_size = 64  # images embedded at once: bounds peak memory; the embeddings do not depend on it

    def load_context(self, context) -> None:
        import torch

        from xbn.evaluation.served import served
        from xbn.models import load_embedder

        checkpoint = context.artifacts[CHECKPOINT_ARTIFACT]
        model_dir = Path(checkpoint).parents[1]
        config = context.model_config or {}
        # Verified before torch.load sees a byte of it: first against the registered version's tag (kept in the
        # tracking store, which the artifact store cannot alter), then against the MLmodel's own record.
        registered = _registered_version(model_dir)
        if registered is not None:
            name, version, expected = registered
            verify_file(checkpoint, expected, what=f"the checkpoint of {name} v{version}")
        if recorded := config.get(CHECKPOINT_SHA256):
            verify_file(checkpoint, recorded, what="checkpoint", recorded="is recorded in its MLmodel")
        elif registered is None:  # logged before hashes were recorded
            logging.getLogger(__name__).warning("%s: no recorded sha256, loading it unverified", checkpoint)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model, data_config, _ = load_embedder(checkpoint, map_location=device, verify=False)
        # Versions logged before the image signature record the size in the MLmodel's metadata only.
        image_size = config.get(IMAGE_SIZE) or _logged_metadata(model_dir).get(IMAGE_SIZE)
        if not image_size:
            raise ValueError(f"{model_dir}: the model records no image_size (model_config or metadata)")
        # The engine: auto for versions logged before the key (it falls back to torch without onnxruntime).
        self.served = served(model, data_config, int(image_size), config.get(CHECKPOINT_SHA256, ""), device,
                             config.get(PRECISION, "auto"), config.get(CHANNELS_LAST, "auto"),
                             engine=config.get(ENGINE, "auto"))
        self.max_pixels = config.get(MAX_PIXELS)
        self.formats = config.get(ALLOWED_FORMATS)
        root = config.get(PATH_ROOT)
        self.path_root = Path(root).resolve() if root else None
        self.data_config = self.served.data_config

    # A DataFrame hint is one MLflow infers no schema from (np.ndarray, of older versions, neither).
    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None):
        if isinstance(model_input, np.ndarray):  # a version logged with the tensor signature
            return self.embed_tensors(model_input)
        return self.embed_rows(model_input)

    def embed_rows(self, frame: pd.DataFrame) -> pd.DataFrame:
        """The image signature's predict: one output row per input row, `embedding` or `error`."""
        import torch

        if IMAGE not in frame and PATH not in frame:  # answered 200 with no rows: a client would think it was heard
            from mlflow.exceptions import INVALID_PARAMETER_VALUE, MlflowException

            raise MlflowException(f"the input has neither an '{IMAGE}' nor a '{PATH}' column (columns: "
                                  f"{list(frame.columns)[:20]}): send the image's bytes or its path",
                                  error_code=INVALID_PARAMETER_VALUE)
        rows = len(frame)
        images = frame[IMAGE].tolist() if IMAGE in frame else [None] * rows
        paths = frame[PATH].tolist() if PATH in frame else [None] * rows
        embeddings: list[list[float] | None] = [None] * rows
        errors: list[str | None] = [None] * rows
        for start in range(0, rows, self.batch_size):
            done, tensors = [], []
            for i in range(start, min(rows, start + self.batch_size)):
                try:  # decoded one at a time: only the model-size tensors of a batch are held
                    tensors.append(self.served.transform(self._image(images[i], paths[i])))
                    done.append(i)
                except (RowError, OSError) as exc:  # OSError: xbn.data.images.UnreadableImage, the filesystem's
                    errors[i] = f"row {frame.index[i]}: {exc}"
            if tensors:
                for i, vector in zip(done, self.served.embed_tensors(torch.stack(tensors))):
                    embeddings[i] = vector.tolist()
        # object columns: None stays None (JSON null), where pandas would infer a string column with NaN
        return pd.DataFrame({EMBEDDING: pd.Series(embeddings, index=frame.index, dtype=object),
                             ERROR: pd.Series(errors, index=frame.index, dtype=object)})

    def embed_tensors(self, batch: np.ndarray) -> np.ndarray:
        """The tensor entry point: float32 [N, 3, H, W] already resized and normalised with the model's mean and
        std (`data_config`) -> L2-normalized float32 embeddings [N, D]."""
        import torch

        images = np.asarray(batch, dtype=np.float32)
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"expected a float32 image batch [N, 3, H, W], got shape {images.shape}")
        chunks = [self.served.embed_tensors(torch.from_numpy(images[i : i + self.batch_size]))
                  for i in range(0, len(images), self.batch_size)]
        return np.concatenate(chunks) if chunks else np.empty((0, self.served.embedding_dim), np.float32)

    def _image(self, data: Any, path: Any):
        """A row's image as RGB: from its bytes, or from its path (not both)."""
        has_data, has_path = not _missing(data), not _missing(path)
        if has_data and has_path:
            raise RowError(f"give '{IMAGE}' or '{PATH}', not both")
        if has_data:
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise RowError(f"'{IMAGE}' holds {type(data).__name__}, not the bytes of an image "
                               f"file (over MLflow's JSON transport, send them base64-encoded)")
            return open_rgb(bytes(data), "the image", formats=self.formats,
                            max_pixels=self.max_pixels)
        if has_path:
            return open_rgb(self._resolve(str(path)), str(path), formats=self.formats,
                            max_pixels=self.max_pixels)
        raise RowError(f"no image: give the file's bytes in '{IMAGE}' or its path in '{PATH}'")

    def _resolve(self, path: str) -> Path:
        if self.path_root is None:
            raise RowError(f"this model reads no paths (load it with model_config "
                           f"{{'{PATH_ROOT}': <folder>}} to read files under a folder); send the bytes in "
                           f"'{IMAGE}'")
        try:
            target = (self.path_root / path).resolve()
        except (ValueError, OSError) as exc:  # a NUL byte, a symlink loop
            raise RowError(f"{path!r} is not a usable path ({exc})") from None
        if not target.is_relative_to(self.path_root):
            raise RowError(f"{path} is outside {PATH_ROOT} {self.path_root}")
        return target


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _logged_metadata(model_dir: Path) -> dict[str, Any]:
    from mlflow.models import Model

    return Model.load(str(model_dir)).metadata or {}


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

    found = yaml.safe_load(meta.read_text()) or {}
    name, version = str(found.get("model_name", "")), str(found.get("model_version", ""))
    if not name or not version.isdigit():  # a logged (unregistered) model's meta says version 'None'
        return None
    expected = MlflowClient().get_model_version(name, version).tags.get(SHA_TAG)
    return (name, version, expected) if expected else None


def signature() -> ModelSignature:
    # Both columns optional: a row gives one of them (MLflow cannot say "exactly one"; predict checks it).
    return ModelSignature(
        inputs=Schema([ColSpec(DataType.binary, IMAGE, required=False),
                       ColSpec(DataType.string, PATH, required=False)]),
        outputs=Schema([ColSpec(Array(DataType.float), EMBEDDING, required=False),
                        ColSpec(DataType.string, ERROR, required=False)]),
    )


def input_example(image_size: int) -> pd.DataFrame:
    """One grey PNG at the model's size: logging validates it through MLflow's JSON transport (base64)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (image_size, image_size), (128, 128, 128)).save(buffer, format="PNG")
    return pd.DataFrame({IMAGE: [buffer.getvalue()]})


def model_config(params, checkpoint_sha256: str) -> dict[str, Any]:
    """What the pyfunc reads at load time (see the module docstring), from `params`. Every key is recorded,
None included: MLflow lets a load override only the keys a model was logged with."""
    return {
        CHECKPOINT_SHA256: checkpoint_sha256,
        IMAGE_SIZE: params.data.image_size,
        PRECISION: params.inference.precision,
        CHANNELS_LAST: params.inference.channels_last,
        ENGINE: params.inference.engine,
        MAX_PIXELS: params.serve.max_pixels,
        ALLOWED_FORMATS: list(params.serve.allowed_formats),
        PATH_ROOT: None,
    }


def package_code(folder: Path) -> Path:
    """A copy of the installed xbn package under `folder` (without byte code), for the model's `code_paths`:
    MLflow puts it on sys.path when it loads the model, so xbn need not be installed there."""
    import shutil

    import xbn

    target = Path(folder) / "xbn"
    shutil.copytree(Path(xbn.__file__).parent, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return target


def pip_requirements() -> list[str]:
    """The installed versions of what the model needs. Given explicitly because MLflow would otherwise infer
    them by loading the model in a subprocess (slow). xbn itself travels as code (`package_code`)."""
    pins = []
    for name in _REQUIREMENTS:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pins.append(name)
    return pins
