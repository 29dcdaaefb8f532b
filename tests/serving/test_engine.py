"""`inference.engine` (issue 44 item 2): ONNX Runtime embeds real images as torch does (the served model and `xbn
embed`), auto times both engines on the first real batch and records why it chose one, falls back to torch when
ONNX Runtime disagrees, the exported graph is cached and a corrupted one rebuilt, and bad settings are config
errors naming the key. A tiny real model, real PNG files."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from serving_support import IMAGE_SIZE
from tests_support import ROOT

import xbn.evaluation.engine as engine_module
from xbn.config import ConfigError, load_params
from xbn.evaluation import onnx_export
from xbn.evaluation.engine import PARITY_COSINE, OnnxEngine, cached_graph_path, engine_for
from xbn.serving.model import load_served_model, open_image
from xbn.utils.integrity import sidecar_path


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """A cache of this test's own, and auto free to choose (the suite pins it to torch: tests/conftest.py)."""
    monkeypatch.setenv("XBN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("XBN_ONNXRUNTIME", raising=False)


@pytest.fixture
def exports(monkeypatch) -> list:
    """The ONNX exports run from here on (each call's path)."""
    calls = []
    real = onnx_export.export_onnx

    def counted(model, path, *args, **kwargs):
        calls.append(path)
        return real(model, path, *args, **kwargs)

    monkeypatch.setattr(onnx_export, "export_onnx", counted)
    return calls


def images_of(image_root):
    return [open_image(p) for p in sorted(image_root.rglob("*.png"))]  # 24 files, grey and RGB


def assert_same_embeddings(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.shape == expected.shape
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= PARITY_COSINE, cosine.min()


def test_onnxruntime_embeds_real_images_as_torch(model_path, image_root):
    torch_model = load_served_model(model_path, IMAGE_SIZE, engine="torch")
    ort_model = load_served_model(model_path, IMAGE_SIZE, engine="onnxruntime")
    assert torch_model.engine is None and ort_model.engine.runs_onnx
    assert ort_model.record()["onnxruntime"] == 1.0 and "engine onnxruntime, chosen by params" in ort_model.describe()
    images = images_of(image_root)
    expected = torch_model.embed_images(images)
    assert_same_embeddings(ort_model.embed_images(images), expected)  # the pixels straight to ONNX Runtime
    assert_same_embeddings(ort_model.embed_images(images[:1]), expected[:1])  # batch 1
    # A DataLoader's normalised tensors (index, embed, evaluate) go back to their pixels, then to ONNX Runtime.
    frame = pd.read_csv(image_root / "manifest.csv")
    rows = ort_model.embed_frame(frame, image_root, batch_size=10)
    assert rows.kept == list(range(len(frame)))
    assert_same_embeddings(rows.embeddings, torch_model.embed_frame(frame, image_root, batch_size=10).embeddings)
    # A batch that is not 8-bit pixels (a caller's own preprocessing) runs in torch: the same answer.
    noise = torch.randn(3, 3, IMAGE_SIZE, IMAGE_SIZE)
    np.testing.assert_allclose(ort_model.embed_tensors(noise), torch_model.embed_tensors(noise), atol=1e-5)


def test_xbn_embed_with_onnxruntime_writes_torchs_embeddings(model_path, image_root, tmp_path, monkeypatch):
    from xbn.cli import main
    from xbn.serving.embed_job import read_embeddings

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for file in (model_path, sidecar_path(model_path)):
        shutil.copy(file, tmp_path / "models" / file.name)
    out = {}
    for engine in ("torch", "onnxruntime"):
        assert main(["embed", "--local", "--input", str(image_root), "--output", f"{engine}.parquet", "-q",
                     "--params", str(ROOT / "params.yaml"), "--set", f"data.image_size={IMAGE_SIZE}",
                     "--set", f"inference.engine={engine}"]) == 0
        frame, emb = read_embeddings(f"{engine}.parquet")
        out[engine] = emb[np.argsort(frame["path"].to_numpy())]
    assert len(out["torch"]) == 24
    assert_same_embeddings(out["onnxruntime"], out["torch"])


@pytest.mark.parametrize(("margin", "chosen"), [(0.0, "onnxruntime"), (float("inf"), "torch")])
def test_auto_times_both_engines_on_the_first_batch_and_records_the_choice(model_path, image_root, monkeypatch,
                                                                          margin, chosen):
    monkeypatch.setattr(engine_module, "MARGIN", margin)  # pins the race's outcome on a loaded machine
    model = load_served_model(model_path, IMAGE_SIZE, engine="auto")
    assert model.engine.choice.pending
    images = images_of(image_root)
    got = model.embed_images(images)
    choice = model.engine.choice
    assert choice.engine == chosen and choice.chosen_by.startswith("auto: ")
    assert set(choice.rates) == {"torch", "onnxruntime"} and min(choice.rates.values()) > 0
    assert choice.cosine >= PARITY_COSINE
    record = model.record()
    assert record["onnxruntime"] == float(chosen == "onnxruntime") and record["engine_torch_images_per_s"] > 0
    assert "onnxruntime_min_cosine" in record and "img/s" in model.describe()
    assert_same_embeddings(got, load_served_model(model_path, IMAGE_SIZE, engine="torch").embed_images(images))
    assert (model.engine.session is not None) == (chosen == "onnxruntime")  # torch chosen: the session goes


def test_auto_keeps_torch_when_onnxruntime_disagrees_and_says_why(model_path, image_root, monkeypatch, caplog):
    monkeypatch.setattr(engine_module, "MARGIN", 0.0)  # faster or not, a disagreeing engine is refused
    real = OnnxEngine.embed_pixels
    monkeypatch.setattr(OnnxEngine, "embed_pixels", lambda self, pixels: np.roll(real(self, pixels), 1, axis=0))
    model = load_served_model(model_path, IMAGE_SIZE, engine="auto")
    images = images_of(image_root)
    got = model.embed_images(images)
    choice = model.engine.choice
    assert choice.engine == "torch" and "disagrees with torch float32" in choice.chosen_by
    assert choice.cosine < PARITY_COSINE and "disagrees" in caplog.text
    np.testing.assert_allclose(got, load_served_model(model_path, IMAGE_SIZE, engine="torch").embed_images(images),
                               atol=1e-6)  # torch's own output, this batch and the next
    assert model.record()["onnxruntime"] == 0.0


def test_the_graph_is_exported_once_and_a_corrupted_copy_is_rebuilt(model_path, image_root, exports, caplog):
    first = load_served_model(model_path, IMAGE_SIZE, engine="onnxruntime")
    path = first.engine.path
    assert len(exports) == 1 and path == cached_graph_path(first.sha256, IMAGE_SIZE) and path.is_file()
    assert first.sha256[:24] in path.name and f"{IMAGE_SIZE}px" in path.name and "opset18" in path.name
    load_served_model(model_path, IMAGE_SIZE, engine="onnxruntime")
    assert len(exports) == 1  # the cached graph, no export

    images = images_of(image_root)[:4]
    expected = load_served_model(model_path, IMAGE_SIZE, engine="torch").embed_images(images)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte: fails the sidecar
    path.write_bytes(bytes(data))
    again = load_served_model(model_path, IMAGE_SIZE, engine="onnxruntime")
    assert len(exports) == 2 and "fails its sha256 sidecar" in caplog.text
    assert_same_embeddings(again.embed_images(images), expected)

    path.write_bytes(b"not a graph")  # replaced, sidecar and all: the sha matches but it does not load
    sidecar_path(path).write_text(f"{hashlib.sha256(b'not a graph').hexdigest()}  {path.name}\n")
    again = load_served_model(model_path, IMAGE_SIZE, engine="onnxruntime")
    assert len(exports) == 3 and "does not load" in caplog.text
    assert_same_embeddings(again.embed_images(images), expected)


def test_a_registered_graph_is_used_only_when_it_is_this_models(model_path, other_model_path, tmp_path, exports):
    mine = onnx_export.export_onnx(load_served_model(model_path, IMAGE_SIZE, engine="torch"), tmp_path / "a.onnx")
    other = onnx_export.export_onnx(load_served_model(other_model_path, IMAGE_SIZE, engine="torch"),
                                    tmp_path / "b.onnx")
    exports.clear()
    assert load_served_model(model_path, IMAGE_SIZE, engine="onnxruntime", onnx_graph=mine).engine.path == mine
    assert not exports
    refused = load_served_model(model_path, IMAGE_SIZE, engine="onnxruntime", onnx_graph=other)
    assert refused.engine.path != other and len(exports) == 1  # another checkpoint's graph: our own export


def test_bad_engine_settings_are_config_errors_naming_the_key(tiny_params):
    with pytest.raises(ConfigError, match=r"inference\.engine"):
        tiny_params("inference.engine=tensorrt")
    assert tiny_params("inference.engine=onnxruntime").inference.engine == "onnxruntime"
    assert load_params(ROOT / "params.yaml").inference.engine == "auto"
    on_gpu = SimpleNamespace(device=torch.device("cuda"))
    with pytest.raises(ConfigError, match=r"inference\.engine: onnxruntime runs on the CPU only"):
        engine_for(on_gpu, "onnxruntime")
    assert engine_for(on_gpu, "auto") is None  # auto on CUDA: torch
    with pytest.raises(ConfigError, match=r"inference\.engine"):
        engine_for(on_gpu, "fast")


def test_export_checks_parity_against_torch_whatever_engine_the_model_runs(model_path, image_root, tmp_path,
                                                                          monkeypatch):
    from xbn.evaluation.onnx_export import check_parity, export_onnx

    model = load_served_model(model_path, IMAGE_SIZE, engine="onnxruntime")
    graph = export_onnx(model, tmp_path / "model.onnx")
    real = OnnxEngine.embed_pixels  # the served model's own ONNX Runtime, broken: parity reads torch, not it
    monkeypatch.setattr(OnnxEngine, "embed_pixels", lambda self, pixels: -real(self, pixels))
    assert check_parity(model, graph, sorted(image_root.rglob("*.png"))[:4]) <= 1e-4


def test_a_registered_version_serves_its_own_checked_graph(tmp_path, monkeypatch):
    import yaml
    from tracking.helpers import run_pipeline, write_manifest

    from xbn.cli import main
    from xbn.config import Params
    from xbn.serving.http import RegistryModelSource
    from xbn.tracking import PARENT_RUN_ENV, Registry
    from xbn.tracking.registry import ONNX_SHA_TAG
    from xbn.utils.errors import IntegrityError
    from xbn.utils.faults import FaultInjected

    monkeypatch.chdir(tmp_path)
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID",
                PARENT_RUN_ENV):
        monkeypatch.delenv(var, raising=False)
    write_manifest(tmp_path / "data/manifest.csv", "v1")
    params = Params.model_validate({
        "data": {"root": "data/images", "image_size": 32, "num_workers": 0},
        "model": {"backbone": "test_resnet", "pretrained": "none", "embedding_dim": 8},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}, "index": {"source": "data/manifest.csv"}})
    Path("params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
    version = run_pipeline(params, seed=0)["version"]
    assert main(["export", "--format", "onnx", "--params", "params.yaml", "-q"]) == 0  # attached to the version
    registry = Registry(params)
    info = registry.get(version)
    fetched = registry.fetch_onnx(info, tmp_path / "fetched")
    assert fetched.read_bytes() == Path("models/model.onnx").read_bytes()
    assert info.tags[ONNX_SHA_TAG] == hashlib.sha256(fetched.read_bytes()).hexdigest()

    # Issue 54 item 6: a new graph's upload stopped before its tag moved leaves the tagged graph served, intact
    # (graphs are kept by digest; uploaded in place, the new bytes replaced the tagged ones for good).
    other = tmp_path / "other" / "model.onnx"
    other.parent.mkdir()
    other.write_bytes(fetched.read_bytes() + b"\0")
    monkeypatch.setenv("XBN_FAULT", "registry.onnx_before_tags:raise")
    with pytest.raises(FaultInjected):
        registry.log_onnx(info, other)
    monkeypatch.delenv("XBN_FAULT")
    info = registry.get(version)
    assert registry.fetch_onnx(info, tmp_path / "after-fault").read_bytes() == fetched.read_bytes()

    source = RegistryModelSource(registry, registry.fetch_index, tmp_path / "serve-cache", pinned=version,
                                 inference={"engine": "onnxruntime"})
    _, model = source.load_model()
    assert model.engine.path.is_relative_to(tmp_path / "serve-cache")  # the version's graph, not an export

    stored = [p for p in tmp_path.rglob("model.onnx") if "mlruns" in p.parts or "mlartifacts" in p.parts
              or "artifacts" in str(p)]
    stored = [p for p in stored if not p.is_relative_to(tmp_path / "fetched")
              and not p.is_relative_to(tmp_path / "serve-cache") and not p.is_relative_to(tmp_path / "models")]
    assert stored, list(tmp_path.rglob("*.onnx"))
    for file in stored:  # the artifact store altered: the download is refused, not served
        file.write_bytes(file.read_bytes() + b"\0")
    with pytest.raises(IntegrityError, match="ONNX graph"):
        registry.fetch_onnx(info, tmp_path / "again")


def test_evaluate_embeds_with_the_engine_and_records_it(tiny_params, tmp_path):
    from xbn.models import build_embedder, save_embedder
    from xbn.stages.evaluate import evaluate
    from xbn.stages.prepare import prepare

    metrics = {}
    for engine in ("torch", "onnxruntime"):
        params = tiny_params(f"inference.engine={engine}", "eval.baseline=false", "eval.embedding_space=false")
        if engine == "torch":
            prepare(params)
            torch.manual_seed(0)
            model, data_config = build_embedder(params.model)
            save_embedder(Path(params.train.checkpoint_dir) / "model.pt", model, params.model, data_config)
        metrics[engine] = evaluate(params)
    assert metrics["onnxruntime"]["inference"]["onnxruntime"] == 1.0
    assert metrics["torch"]["inference"]["onnxruntime"] == 0.0
    for key in ("recall@1", "recall@4", "map@r"):
        assert metrics["onnxruntime"][key] == pytest.approx(metrics["torch"][key], abs=1e-6)
