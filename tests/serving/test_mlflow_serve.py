"""`mlflow models serve` works out of the box on a registered version: a client posts base64 images as MLflow's
JSON transport carries binary columns, and gets the embeddings `xbn embed` writes for the same files. A real
SQLite store and registry version (tests/tracking's helpers), the real `mlflow` CLI and its scoring server
in a subprocess on 127.0.0.1, real PNG, JPEG and WebP files."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml
from infra.support import free_port, stop, tail, wait_http
from tests_support import fresh_environment
from tracking.helpers import run_pipeline, write_images, write_manifest

from xbn.cli import main
from xbn.config import Params
from xbn.serving.embed_job import read_embeddings
from xbn.stages.index import index
from xbn.tracking import PARENT_RUN_ENV

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture
def project(tmp_path, monkeypatch) -> Params:
    """tmp_path laid out like the project, with a fresh store in it and params.yaml."""
    monkeypatch.chdir(tmp_path)
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID",
                PARENT_RUN_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("USER", "tester")
    write_manifest(tmp_path / "data/manifest.csv", "v1")
    params = Params.model_validate({
        "data": {"root": "data/images", "image_size": 32, "num_workers": 0},
        "model": {"backbone": "test_resnet", "pretrained": "none", "embedding_dim": 8},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    })
    Path("params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
    return params


def post_json(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_mlflow_models_serve_embeds_base64_images_as_xbn_embed(project, tmp_path):
    report = run_pipeline(project, seed=0)  # v1, the champion `xbn embed` serves by default...
    assert index(project)["champion"]  # ...once its index is attached (promote last)
    files = write_images(tmp_path / "queries")

    port, log = free_port(), tmp_path / "serve.log"
    env = {**os.environ, "MLFLOW_TRACKING_URI": project.tracking.uri,
           # The scoring server is started as `uvicorn ...` by a shell: it must find the venv's scripts, and
           # the model's code (`xbn`) this checkout's.
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "mlflow", "models", "serve", "-m",
               f"models:/{project.registry.model_name}/{report['version']}", "--env-manager", "local",
               "-h", "127.0.0.1", "-p", str(port)]
    with log.open("w") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # While the server starts (tens of seconds: mlflow, torch and timm imported twice), `xbn embed` runs.
        assert main(["embed", "--input", "queries", "--output", "emb.parquet", "--params", "params.yaml",
                     "--quiet"]) == 0
        wait_http(f"http://127.0.0.1:{port}/ping", server, log, timeout=120)
        records = [{"image": base64.b64encode(f.read_bytes()).decode()} for f in files]
        records.append({"image": base64.b64encode(b"not an image").decode()})
        status, answer = post_json(f"http://127.0.0.1:{port}/invocations", {"dataframe_records": records})
    finally:
        stop(server)

    assert status == 200, (answer, tail(log))
    rows = answer["predictions"]
    assert len(rows) == len(files) + 1
    assert all(row["error"] is None for row in rows[:-1]), rows
    got = np.array([row["embedding"] for row in rows[:-1]], dtype=np.float32)
    frame, embedded = read_embeddings("emb.parquet")
    expected = np.stack([dict(zip(frame["path"], embedded))[f.name] for f in files])
    assert np.abs(got - expected).max() <= 1e-5
    # A bad image is answered in its row; the batch is not failed for it.
    assert rows[-1] == {"embedding": None,
                        "error": f"row {len(files)}: cannot read the image: not an image format PIL can identify"}

    # The model carries xbn's code: it loads and embeds in a new environment without xbn, outside the checkout,
    # which holds what the model's requirements.txt names and nothing else.
    import mlflow

    model = Path(mlflow.artifacts.download_artifacts(f"models:/{project.registry.model_name}/{report['version']}",
                                                     dst_path=str(tmp_path / "downloaded"),
                                                     tracking_uri=project.tracking.uri))
    assert (model / "code" / "xbn" / "tracking" / "pyfunc.py").is_file()
    # Exactly the model's own requirements, installed by pip (torch alone linked from here: gigabytes).
    python = fresh_environment(tmp_path / "venv", requirements=["-r", str(model / "requirements.txt")])
    script = (f"import json, mlflow.pyfunc, pandas as pd\n"
              f"model = mlflow.pyfunc.load_model({str(model)!r})\n"
              f"files = {[str(f) for f in files]!r}\n"
              f"rows = model.predict(pd.DataFrame({{'image': [open(f, 'rb').read() for f in files]}}))\n"
              f"import xbn\n"
              f"print(json.dumps({{'xbn': xbn.__file__, 'embeddings': [list(map(float, e)) for e in rows['embedding']]}}))")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # The store it checks the version against is the one a serving host names in its environment.
    done = subprocess.run([str(python), "-c", script], cwd=elsewhere, capture_output=True, text=True, timeout=300,
                          env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                               "MLFLOW_TRACKING_URI": project.tracking.uri})
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(loaded["xbn"]).is_relative_to(model / "code")  # the model's copy, not an installed xbn
    assert np.abs(np.array(loaded["embeddings"], dtype=np.float32) - expected).max() <= 1e-5

    # `xbn export` puts the same model on the version as an mlflow.onnx model: uint8 pixels in, no xbn needed.
    import mlflow.onnx
    from mlflow import MlflowClient

    from xbn.stages.export import export

    exported = export(project)
    assert exported["version"] == report["version"]
    tags = MlflowClient(project.tracking.uri).get_model_version(project.registry.model_name,
                                                               str(report["version"])).tags
    mlflow.set_tracking_uri(project.tracking.uri)
    graph = mlflow.onnx.load_model(tags["onnx_model_uri"])
    assert graph.graph.input[0].type.tensor_type.elem_type == 2  # onnx.TensorProto.UINT8

