"""The pyfunc speaks images: a DataFrame of encoded image bytes (or paths under a folder the loader names) in,
the embeddings `xbn embed` writes for the same files out; a bad row is answered with an error naming it while
the others embed; the tensor entry point stays for callers who preprocess. A real SQLite store, a tiny real
model, real image files."""

from __future__ import annotations

import io
from pathlib import Path

import mlflow
import mlflow.onnx
import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from xbn.serving.embed_job import embed_to_parquet, read_embeddings
from xbn.serving.model import load_served_model
from xbn.tracking import log_model, pipeline_run
from xbn.tracking.pyfunc import EMBEDDING, ERROR, IMAGE, PATH

from .helpers import write_images, write_model

# float32 on both sides (XBN_CPU_BF16=0); what may differ is the batch's composition and the memory format.
PARITY = 1e-5


def xbn_embed(params, folder: Path, out: Path) -> dict[str, np.ndarray]:
    """What `xbn embed --local` writes for the files of `folder` (its job, its model loading), by file name."""
    served = load_served_model("models/model.pt", params.data.image_size, **params.inference.model_dump())
    embed_to_parquet(served, folder, out, progress=False)
    frame, emb = read_embeddings(out)
    return dict(zip(frame["path"], emb))


@pytest.fixture
def logged(params) -> str:
    write_model(params, seed=1)
    with pipeline_run(params, "train", new=True) as run:
        return log_model(params, run)


def test_image_bytes_embed_as_xbn_embed_embeds_the_files(params, logged, tmp_path):
    files = write_images(tmp_path / "images")
    model = mlflow.pyfunc.load_model(logged)
    out = model.predict(pd.DataFrame({IMAGE: [f.read_bytes() for f in files]}))

    assert list(out.columns) == [EMBEDDING, ERROR] and len(out) == len(files)
    assert out[ERROR].isna().all(), out[ERROR].tolist()
    got = np.array(out[EMBEDDING].tolist(), dtype=np.float32)
    expected = xbn_embed(params, tmp_path / "images", tmp_path / "emb.parquet")
    assert got.shape == (len(files), params.model.embedding_dim)
    assert np.abs(got - np.stack([expected[f.name] for f in files])).max() <= PARITY
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    # Not a constant: the files embed apart, and the transparent half counts as white, not as its stored black.
    assert np.abs(got[0] - got[2]).max() > 1e-3
    black = files[2].with_name("black.png")
    Image.open(files[2]).convert("RGB").save(black)  # the same pixels with the alpha dropped
    dropped = model.predict(pd.DataFrame({IMAGE: [black.read_bytes()]}))[EMBEDDING][0]
    assert np.abs(np.array(dropped) - got[2]).max() > 1e-3


def test_paths_are_read_only_under_the_folder_the_loader_names(params, logged, tmp_path):
    files = write_images(tmp_path / "images")
    frame = pd.DataFrame({PATH: ["rgb.png", str(files[3]), "../outside.png"]})
    (tmp_path / "outside.png").write_bytes(files[0].read_bytes())

    # By default the model reads no files: a served endpoint must not open whatever path a client names.
    refused = mlflow.pyfunc.load_model(logged).predict(frame)
    assert refused[EMBEDDING].isna().all()
    assert refused[ERROR][0].startswith("row 0: this model reads no paths (load it with model_config")

    model = mlflow.pyfunc.load_model(logged, model_config={"path_root": str(tmp_path / "images")})
    out = model.predict(frame)
    assert out[ERROR][:2].isna().all() and out[ERROR][2] == (
        f"row 2: ../outside.png is outside path_root {tmp_path / 'images'}")
    expected = xbn_embed(params, tmp_path / "images", tmp_path / "emb.parquet")
    got = np.array(out[EMBEDDING][:2].tolist(), dtype=np.float32)
    assert np.abs(got - np.stack([expected["rgb.png"], expected["photo.jpg"]])).max() <= PARITY

    # Issue 41: a FIFO inside path_root blocked the request forever; now it is the row's error, at once.
    import os

    os.mkfifo(tmp_path / "images" / "pipe.png")
    piped = model.predict(pd.DataFrame({PATH: ["pipe.png"]}))
    assert piped[ERROR][0].startswith("row 0: cannot read pipe.png: not a regular file")
    # A frame with neither column answered 200 and no rows; now it is refused, naming the columns.
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException, match="neither an 'image' nor a 'path' column"):
        model.unwrap_python_model().embed_rows(pd.DataFrame({"img": [b"x"]}))


def test_a_bad_row_gets_an_error_naming_it_and_the_others_embed(params, logged, tmp_path):
    good = write_images(tmp_path / "images")[0].read_bytes()
    huge = io.BytesIO()
    Image.new("L", (9000, 5000)).save(huge, format="PNG")  # 45 M pixels in a few kB: over serve.max_pixels
    gif = io.BytesIO()
    Image.new("RGB", (40, 40)).save(gif, format="TIFF")  # a format serve.allowed_formats leaves out
    rows = pd.DataFrame({
        IMAGE: [good, good[: len(good) // 2], b"not an image", b"", huge.getvalue(), gif.getvalue(), None, good],
        PATH: [None, None, None, None, None, None, None, "rgb.png"],
    })
    out = mlflow.pyfunc.load_model(logged).predict(rows)

    errors = out[ERROR].tolist()
    assert errors[0] is None and len(out[EMBEDDING][0]) == params.model.embedding_dim
    assert errors[1].startswith("row 1: cannot read the image: truncated image")
    assert errors[2] == "row 2: cannot read the image: not an image format PIL can identify"
    assert errors[3] == "row 3: cannot read the image: it is empty"
    assert errors[4] == "row 4: the image is 9000x5000 pixels, over the limit of 40000000 pixels"
    assert errors[5] == "row 5: TIFF images are not accepted here (accepted: JPEG, PNG, WEBP, GIF, BMP)"
    assert errors[6] == "row 6: no image: give the file's bytes in 'image' or its path in 'path'"
    assert errors[7] == "row 7: give 'image' or 'path', not both"
    assert out[EMBEDDING][1:].isna().all()
    # The good row's embedding does not depend on its bad neighbours.
    alone = mlflow.pyfunc.load_model(logged).predict(pd.DataFrame({IMAGE: [good]}))[EMBEDDING][0]
    np.testing.assert_allclose(out[EMBEDDING][0], alone, atol=1e-6)


def test_the_tensor_entry_point_embeds_a_preprocessed_batch(params, logged):
    embedder = write_model(params, seed=1)  # the same weights as the logged checkpoint
    batch = np.random.default_rng(0).standard_normal((5, 3, 32, 32), dtype=np.float32)
    out = mlflow.pyfunc.load_model(logged).unwrap_python_model().embed_tensors(batch)
    with torch.no_grad():
        expected = embedder(torch.from_numpy(batch)).numpy()
    assert out.shape == (5, params.model.embedding_dim) and out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    info = mlflow.models.get_model_info(logged)
    assert info.metadata["mean"] == [0.5, 0.5, 0.5]  # how a caller of embed_tensors normalizes
    assert info.signature.inputs.input_names() == [IMAGE, PATH]


def pixels_by_rule(path: Path, rule: dict) -> np.ndarray:
    """An image file as the ONNX file's JSON tells a client to prepare it, written from the JSON alone (PIL,
    no xbn code): what a client in another language reproduces."""
    image = Image.open(path)
    if image.has_transparency_data:
        background = Image.new("RGBA", image.size, (*rule["decode"]["background"], 255))
        image = Image.alpha_composite(background, image.convert("RGBA"))
    image = image.convert("RGB")
    width, height = image.size
    side = rule["resize"]["shorter_side"]
    if width <= height:
        size = (side, int(side * height / width))
    else:
        size = (int(side * width / height), side)
    if size != image.size:
        image = image.resize(size, Image.Resampling[rule["resize"]["interpolation"].upper()])
    crop_h, crop_w = rule["center_crop"]["height"], rule["center_crop"]["width"]
    top, left = round((size[1] - crop_h) / 2), round((size[0] - crop_w) / 2)
    return np.asarray(image.crop((left, top, left + crop_w, top + crop_h)))


def test_the_onnx_file_and_its_json_embed_as_the_pyfunc(params, logged, tmp_path):
    import json

    from xbn.evaluation.onnx_export import export_onnx, onnx_embed, rule_path

    files = write_images(tmp_path / "images")
    served = load_served_model("models/model.pt", params.data.image_size)
    onnx_file = export_onnx(served, tmp_path / "model.onnx")
    rule = json.loads(rule_path(onnx_file).read_text())
    pixels = np.stack([pixels_by_rule(f, rule) for f in files])
    assert pixels.dtype == np.uint8 and pixels.shape == (len(files), *rule["input"]["shape"][1:])

    got = onnx_embed(onnx_file, pixels)
    out = mlflow.pyfunc.load_model(logged).predict(pd.DataFrame({IMAGE: [f.read_bytes() for f in files]}))
    expected = np.array(out[EMBEDDING].tolist(), dtype=np.float32)
    assert np.abs(got - expected).max() <= 1e-5  # measured 1.2e-7: the same pixels, float32 both sides
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)

    # The same graph as an MLflow onnx model (what log_onnx logs in the version's run): loadable without xbn's
    # code by mlflow.onnx and by the onnx pyfunc (onnxruntime), with the uint8 signature.
    from xbn.evaluation.onnx_export import INPUT, save_mlflow_onnx

    folder = save_mlflow_onnx(onnx_file, tmp_path / "mlflow_onnx")
    assert mlflow.onnx.load_model(str(folder)).graph.input[0].name == INPUT
    loaded = mlflow.pyfunc.load_model(str(folder))
    inputs = loaded.metadata.get_input_schema().inputs
    assert [(i.name, i.type, i.shape[1:]) for i in inputs] == [(INPUT, np.dtype("uint8"), tuple(rule["input"]["shape"][1:]))]
    answer = loaded.predict(pixels)
    via_pyfunc = np.asarray(next(iter(answer.values())) if isinstance(answer, dict) else answer, dtype=np.float32)
    assert np.abs(via_pyfunc - got).max() <= 1e-6


def test_a_version_logged_with_the_tensor_signature_still_predicts_on_tensors(params):
    # The logged code imports the installed xbn: a version registered before the image signature runs this
    # class with its old MLmodel (a tensor signature, only the hash in model_config, the size in metadata).
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    from xbn.tracking import file_digest
    from xbn.tracking.pyfunc import CHECKPOINT_ARTIFACT, CHECKPOINT_SHA256, MODEL_CODE

    embedder = write_model(params, seed=2)
    with pipeline_run(params, "train", new=True):
        uri = mlflow.pyfunc.log_model(
            name="old", python_model=str(MODEL_CODE), artifacts={CHECKPOINT_ARTIFACT: "models/model.pt"},
            model_config={CHECKPOINT_SHA256: file_digest("models/model.pt")},
            signature=ModelSignature(inputs=Schema([TensorSpec(np.dtype(np.float32), (-1, 3, -1, -1))])),
            metadata={"image_size": 32}, pip_requirements=["torch"]).model_uri
    batch = np.random.default_rng(1).standard_normal((3, 3, 32, 32), dtype=np.float32)
    with torch.no_grad():
        expected = embedder(torch.from_numpy(batch)).numpy()
    np.testing.assert_allclose(mlflow.pyfunc.load_model(uri).predict(batch), expected, rtol=1e-5, atol=1e-6)


def test_the_pyfunc_runs_the_engine_it_is_configured_with(params, logged, tmp_path, monkeypatch):
    from xbn.tracking.pyfunc import ENGINE, model_config

    monkeypatch.setenv("XBN_CACHE_DIR", str(tmp_path / "cache"))  # the graph it exports on load
    assert model_config(params, "")[ENGINE] == params.inference.engine == "auto"
    files = write_images(tmp_path / "images")
    frame = pd.DataFrame({IMAGE: [f.read_bytes() for f in files]})
    default = mlflow.pyfunc.load_model(logged)  # auto, which the suite pins to torch (tests/conftest.py)
    assert default.unwrap_python_model().served.engine is None
    onnx = mlflow.pyfunc.load_model(logged, model_config={ENGINE: "onnxruntime"})
    assert onnx.unwrap_python_model().served.engine.runs_onnx
    expected = np.array(default.predict(frame)[EMBEDDING].tolist(), dtype=np.float32)
    got = np.array(onnx.predict(frame)[EMBEDDING].tolist(), dtype=np.float32)
    assert ((got * expected).sum(1) >= 0.9999).all() and np.abs(got - expected).max() <= 1e-5


def test_logging_the_model_does_not_map_every_installed_distribution(params, monkeypatch):
    """MLflow's pin check maps every installed distribution to its modules (about 3 s of the 4 s a registration
    took); our pins are this environment's own, so xbn skips it, and puts it back afterwards."""
    import importlib_metadata
    from mlflow.utils import environment, requirements_utils

    check = environment.warn_dependency_requirement_mismatches
    monkeypatch.setattr(requirements_utils, "_MODULES_TO_PACKAGES", None)  # as in a fresh process
    monkeypatch.setattr(importlib_metadata, "packages_distributions",
                        lambda: pytest.fail("log_model mapped every installed distribution"))
    write_model(params, seed=1)
    with pipeline_run(params, "train", new=True) as run:
        uri = log_model(params, run)
    assert uri.startswith("models:/") and environment.warn_dependency_requirement_mismatches is check
    assert mlflow.pyfunc.warn_dependency_requirement_mismatches is check
