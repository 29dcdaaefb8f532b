"""The compose stack's MLflow service, natively: a real `mlflow server` on loopback with a PostgreSQL backend
store and proxied artifacts, and the tiny pipeline (prepare -> validate -> train -> evaluate -> register) run
against it over HTTP, registry included."""

from __future__ import annotations

import hashlib
import http.client
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests_support import ROOT, TINY

from .support import admin_execute, env_example, free_port, require_postgres, stop, wait_http

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("mlflow-server")]

MODEL_NAME = "xbn-embedder"  # registry.model_name in params.yaml
CLIENT_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID",
              "MLFLOW_RUN_ID", "XBN_PARENT_RUN_ID")


@dataclass(frozen=True)
class Server:
    url: str
    port: int
    database: str
    artifacts: Path
    log: Path


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory) -> Iterator[Server]:
    """`mlflow server` with a fresh PostgreSQL database as its backend store, artifacts served from a local
    directory (s3://mlflow in compose), and compose's --allowed-hosts value from .env.example."""
    require_postgres()
    database = f"xbninfra_{uuid.uuid4().hex[:8]}_mlflow"
    home = tmp_path_factory.mktemp("mlflow-server")
    artifacts, log = home / "artifacts", home / "server.log"
    port = free_port()
    admin_execute(f'CREATE DATABASE "{database}"')
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV}
    cmd = [sys.executable, "-m", "mlflow", "server",
           "--backend-store-uri", f"postgresql+psycopg2://postgres@127.0.0.1:5432/{database}",
           "--artifacts-destination", str(artifacts),
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--allowed-hosts", env_example()["MLFLOW_ALLOWED_HOSTS"]]
    proc = None
    try:
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        server = Server(f"http://127.0.0.1:{port}", port, database, artifacts, log)
        wait_http(f"{server.url}/health", proc, log, timeout=180)  # the first start migrates the database
        yield server
    finally:
        if proc is not None:
            stop(proc)
        admin_execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


@pytest.fixture
def client_env(mlflow_server, tmp_path, monkeypatch):
    """tmp_path as the working directory and the server as the tracking URI, restored afterwards."""
    import mlflow

    monkeypatch.chdir(tmp_path)
    for var in CLIENT_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    yield
    while mlflow.active_run():
        mlflow.end_run()
    # The stages set it globally, and in the environment (which monkeypatch restores).
    mlflow.set_tracking_uri(None)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_pipeline_registers_a_champion_through_the_server(mlflow_server, client_env, tmp_path,
                                                               glyph_root):
    import mlflow
    from mlflow.tracking import MlflowClient

    from xbn.config import load_params
    from xbn.stages.evaluate import evaluate
    from xbn.stages.prepare import prepare
    from xbn.stages.register import register
    from xbn.stages.train import train
    from xbn.stages.validate import validate

    params = load_params(ROOT / "params.yaml", [*TINY, f"data.root={glyph_root}", "tracking.enabled=true"])
    prepare(params)
    validate(params)
    train(params, progress=False)
    evaluate(params)
    report = register(params)
    assert report["version"] == 1 and report["decision"] == "promoted" and report["alias"] == "champion"

    # The registry, as the server reports it.
    client = MlflowClient(mlflow_server.url)
    champion = client.get_model_version_by_alias(MODEL_NAME, "champion")
    assert champion.version == "1"
    local_sha = sha256(Path(params.train.checkpoint_dir) / "model.pt")
    assert champion.tags["model_sha256"] == local_sha
    run = client.get_run(champion.run_id)
    assert run.data.metrics["recall_at_1"] == pytest.approx(report["metrics"]["recall@1"])
    assert {"metrics", "plots", "validation"} <= {a.path for a in client.list_artifacts(run.info.run_id)}

    # Artifacts go through the server (mlflow-artifacts:/ proxy), never to a path the client writes itself.
    assert run.info.artifact_uri.startswith("mlflow-artifacts:"), run.info.artifact_uri
    downloaded = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{MODEL_NAME}@champion",
                                                          dst_path=str(tmp_path / "download")))
    assert (downloaded / "MLmodel").is_file()
    served = {sha256(p) for p in downloaded.rglob("*") if p.is_file()}
    assert local_sha in served, "the checkpoint was not served back"
    stored = {sha256(p) for p in mlflow_server.artifacts.rglob("*") if p.is_file()}
    assert local_sha in stored, "the checkpoint is not in the server's --artifacts-destination"
    assert not (tmp_path / "mlartifacts").exists() and not (tmp_path / "mlruns").exists()

    # And the registry lives in PostgreSQL, the backend store.
    versions = admin_execute("SELECT name, version FROM model_versions", dbname=mlflow_server.database)
    aliases = admin_execute("SELECT name, alias, version FROM registered_model_aliases",
                            dbname=mlflow_server.database)
    assert versions == [(MODEL_NAME, 1)] and (MODEL_NAME, "champion", 1) in aliases


def test_compose_allowed_hosts_admit_the_network_name_only(mlflow_server):
    """compose passes MLFLOW_ALLOWED_HOSTS to --allowed-hosts: containers reach the server as mlflow:5000,
    and any other Host header is refused (DNS-rebinding guard)."""

    def status(host: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", mlflow_server.port, timeout=10)
        try:
            conn.request("GET", "/api/2.0/mlflow/experiments/search?max_results=1", headers={"Host": host})
            return conn.getresponse().status
        finally:
            conn.close()

    assert status("mlflow:5000") == 200
    assert status("localhost:5000") == 200
    assert status("rebinding.example:5000") == 403
