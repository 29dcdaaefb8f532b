"""The compose stack's MLflow service, natively: a real `mlflow server --app-name basic-auth` on loopback with a
PostgreSQL backend store, its auth database on PostgreSQL too, `default_permission = NO_PERMISSIONS`, proxied
artifacts, and the accounts of infra/README.md provisioned by `python -m xbn.tracking.accounts`. The tiny
pipeline (prepare -> validate -> train -> evaluate -> register -> index) runs against it over HTTP as the
pipeline's service account; then each account is held to what it may do (issue 41)."""

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

from xbn.tracking.accounts import password_variable
from xbn.tracking.registry import INDEX_SHA_TAG

from .support import admin_execute, env_example, free_port, require_postgres, stop, wait_http

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("mlflow-server")]

MODEL_NAME = "xbn-embedder"  # registry.model_name in params.yaml
CLIENT_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID",
              "MLFLOW_RUN_ID", "XBN_PARENT_RUN_ID")


ADMIN = ("admin", "admin-pw-for-tests-only")
# role, username, password: infra/README.md's table of accounts
ACCOUNTS = {"pipeline": ("xbn-pipeline", "pipeline-pw-0001"), "reader": ("xbn-serve", "serve-pw-00000001"),
            "reviewer": ("alice", "alice-pw-00000001")}


@dataclass(frozen=True)
class Server:
    url: str
    port: int
    database: str
    artifacts: Path
    log: Path

    @property
    def store(self) -> str:
        """The backend store itself: where a worker on the database, and every registry lock, lives here."""
        return f"postgresql+psycopg2://postgres@127.0.0.1:5432/{self.database}"


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> Iterator[Server]:
    """`mlflow server` with a fresh PostgreSQL database as its backend store, artifacts served from a local
    directory (s3://mlflow in compose), and compose's --allowed-hosts value from .env.example."""
    require_postgres()
    database = f"xbninfra_{uuid.uuid4().hex[:8]}_mlflow"
    home = tmp_path_factory.mktemp("mlflow-server")
    artifacts, log = home / "artifacts", home / "server.log"
    port = free_port()
    admin_execute(f'CREATE DATABASE "{database}"', f'CREATE DATABASE "{database}_auth"')
    # infra/mlflow/basic_auth.ini with this test's auth database; the admin's password from the environment.
    ini = (ROOT / "infra/mlflow/basic_auth.ini").read_text().replace(
        "postgresql+psycopg2://mlflow_auth@postgres:5432/mlflow_auth",
        f"postgresql+psycopg2://postgres@127.0.0.1:5432/{database}_auth")
    (home / "basic_auth.ini").write_text(ini)
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV + ("MLFLOW_TRACKING_USERNAME",
                                                                        "MLFLOW_TRACKING_PASSWORD")}
    env |= {"MLFLOW_AUTH_CONFIG_PATH": str(home / "basic_auth.ini"), "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN[1],
            "MLFLOW_FLASK_SERVER_SECRET_KEY": uuid.uuid4().hex}
    cmd = [sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth",
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
        provision = [sys.executable, "-m", "xbn.tracking.accounts", "--uri", server.url,
                     *(f"--account={role}:{user}" for role, (user, _) in ACCOUNTS.items())]
        secrets_env = {**env, "MLFLOW_TRACKING_USERNAME": ADMIN[0], "MLFLOW_TRACKING_PASSWORD": ADMIN[1],
                       **{password_variable(user): pw for user, pw in ACCOUNTS.values()}}
        done = subprocess.run(provision, env=secrets_env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        yield server
    finally:
        if proc is not None:
            stop(proc)
        admin_execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)',
                      f'DROP DATABASE IF EXISTS "{database}_auth" WITH (FORCE)')


@pytest.fixture
def client_env(mlflow_server, tmp_path, monkeypatch):
    """tmp_path as the working directory and the server as the tracking URI, restored afterwards."""
    import mlflow

    monkeypatch.chdir(tmp_path)
    for var in CLIENT_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    monkeypatch.setenv("XBN_LOCK_URI", mlflow_server.store)  # the server offers no lock (infra/README.md)
    as_account(monkeypatch, "pipeline")
    yield
    while mlflow.active_run():
        mlflow.end_run()
    # The stages set it globally, and in the environment (which monkeypatch restores).
    mlflow.set_tracking_uri(None)


def as_account(monkeypatch, role: str) -> str:
    """Act as the account of `role` (MLflow's client reads the credentials from the environment)."""
    user, password = ACCOUNTS[role] if role in ACCOUNTS else ADMIN
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    return user


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def registered(mlflow_server, glyph_root, tmp_path_factory):
    """The tiny pipeline (prepare -> validate -> train -> evaluate -> register -> index), once per server, as the
    pipeline's account, in a folder of its own: what the other tests of the module find in the registry,
    whatever order xdist runs them in. Session-scoped, as the server is: a module fixture is set up again each
    time another module's tests come between (three servers and pipelines in one make test, 4 minutes)."""
    import mlflow

    from xbn.config import load_params
    from xbn.stages.evaluate import evaluate
    from xbn.stages.index import index
    from xbn.stages.prepare import prepare
    from xbn.stages.register import register
    from xbn.stages.train import train
    from xbn.stages.validate import validate

    work = tmp_path_factory.mktemp("pipeline")
    names = (*CLIENT_ENV, "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "XBN_LOCK_URI")
    saved, cwd = {k: os.environ.get(k) for k in names}, os.getcwd()
    for name in CLIENT_ENV:
        os.environ.pop(name, None)
    user, password = ACCOUNTS["pipeline"]
    os.environ.update({"MLFLOW_TRACKING_URI": mlflow_server.url, "MLFLOW_TRACKING_USERNAME": user,
                       "MLFLOW_TRACKING_PASSWORD": password, "XBN_LOCK_URI": mlflow_server.store})
    os.chdir(work)
    try:
        params = load_params(ROOT / "params.yaml", [*TINY, f"data.root={glyph_root}", "tracking.enabled=true"])
        prepare(params)
        validate(params)
        train(params, progress=False)
        evaluate(params)
        report = register(params)
        indexed = index(params)  # the champion's index, for the serving account
    finally:
        while mlflow.active_run():
            mlflow.end_run()
        mlflow.set_tracking_uri(None)
        os.chdir(cwd)
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
    return params, report, indexed, work


def test_tiny_pipeline_registers_a_champion_through_the_server(mlflow_server, registered, client_env, tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient

    params, report, indexed, work = registered
    # Promote last: the gate's promotion takes effect once the index is attached.
    assert report["version"] == 1 and report["decision"] == "promoted" and report["alias"] == "challenger"
    assert report["registration"] == "awaiting_index" and report["champion_version"] is None
    assert indexed["version"] == 1 and indexed["champion"]

    # The registry, as the server reports it.
    client = MlflowClient(mlflow_server.url)
    champion = client.get_model_version_by_alias(MODEL_NAME, "champion")
    assert champion.version == "1"
    local_sha = sha256(work / params.train.checkpoint_dir / "model.pt")
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
    assert not (work / "mlartifacts").exists() and not (work / "mlruns").exists()

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
            conn.request("GET", "/api/2.0/mlflow/experiments/search?max_results=1",
                         headers={"Host": host, "Authorization": basic("pipeline")})
            return conn.getresponse().status
        finally:
            conn.close()

    assert status("mlflow:5000") == 200
    assert status("localhost:5000") == 200
    assert status("rebinding.example:5000") == 403


def basic(role: str) -> str:
    import base64

    user, password = ACCOUNTS.get(role, ADMIN)
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def call(server: Server, method: str, path: str, role: str | None, body: dict | None = None) -> int:
    """The HTTP status of one REST request, as `role` (None: anonymous)."""
    import json

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    headers = {"Content-Type": "application/json", **({"Authorization": basic(role)} if role else {})}
    if method == "GET":  # MLflow reads a GET's parameters from the query string
        from urllib.parse import urlencode

        path, body = f"{path}?{urlencode(body or {})}", None
    try:
        conn.request(method, f"/api/2.0/mlflow/{path}", body=None if body is None else json.dumps(body),
                     headers=headers)
        return conn.getresponse().status
    finally:
        conn.close()


WRITES = [  # (method, endpoint, body): what a compromised process on the network would try
    ("POST", "registered-models/create", {"name": "planted"}),
    ("POST", "registered-models/set-tag", {"name": MODEL_NAME, "key": "model_sha256", "value": "0" * 64}),
    ("POST", "registered-models/alias", {"name": MODEL_NAME, "alias": "champion", "version": "1"}),
    ("POST", "model-versions/set-tag", {"name": MODEL_NAME, "version": "1", "key": "decision", "value": "x"}),
    ("DELETE", "registered-models/alias", {"name": MODEL_NAME, "alias": "champion"}),
    ("DELETE", "registered-models/delete", {"name": MODEL_NAME}),
    ("POST", "experiments/create", {"name": "planted"}),
]


def test_each_account_may_do_what_its_role_allows_and_nothing_more(mlflow_server, registered, client_env):
    """Issue 41: the status codes of the same requests for each account (the note gives the table)."""
    statuses = {role: {f"{m} {p}": call(mlflow_server, m, p, role, b) for m, p, b in WRITES}
                for role in (None, "reader")}
    print("status codes:", statuses)
    assert set(statuses[None].values()) == {401}  # anonymous: not one write
    # The serving account may not touch xbn's model. MLflow lets any authenticated account create a model or an
    # experiment of its own (its creator then manages it): that changes nothing xbn reads.
    creates = {"POST registered-models/create", "POST experiments/create"}
    assert {k: v for k, v in statuses["reader"].items() if k not in creates} == {
        f"{m} {p}": 403 for m, p, _ in WRITES if f"{m} {p}" not in creates}
    get = "registered-models/get"
    assert call(mlflow_server, "GET", get, "reader", {"name": MODEL_NAME}) == 200
    assert call(mlflow_server, "GET", get, None, {"name": MODEL_NAME}) == 401
    # The pipeline and a reviewer may move aliases and write tags (EDIT), never delete (MANAGE: the admin).
    for role in ("pipeline", "reviewer"):
        assert call(mlflow_server, "POST", "model-versions/set-tag", role,
                    {"name": MODEL_NAME, "version": "1", "key": f"seen_by_{role}", "value": "1"}) == 200
        assert call(mlflow_server, "DELETE", "registered-models/delete", role, {"name": MODEL_NAME}) == 403
        assert call(mlflow_server, "DELETE", "model-versions/delete", role,
                    {"name": MODEL_NAME, "version": "1"}) == 403
    assert call(mlflow_server, "GET", get, "admin", {"name": MODEL_NAME}) == 200


def test_the_serving_account_serves_the_champion(mlflow_server, registered, client_env, monkeypatch, glyph_root):
    from serving.serving_support import running

    from xbn.config import load_params
    from xbn.stages.serve import serving_app

    as_account(monkeypatch, "reader")
    params = load_params(ROOT / "params.yaml", [*TINY, f"data.root={glyph_root}", "tracking.enabled=true"])
    with running(serving_app(params, token=None)) as client:  # what `xbn serve` runs
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["alias"] == "champion"
        image = next(glyph_root.rglob("*.png")).read_bytes()
        found = client.post("/search", files={"image": ("q.png", image)}, data={"k": "3"})
        assert found.status_code == 200 and len(found.json()["results"]) == 3


def test_a_reviewer_promotes_as_themselves_and_a_wrong_password_is_one_line(mlflow_server, registered, client_env,
                                                                             monkeypatch, tmp_path, capsys,
                                                                             glyph_root):
    import yaml
    from mlflow.tracking import MlflowClient

    from xbn.cli import EXIT_CONFIG, main
    from xbn.config import load_params
    from xbn.tracking import Registry

    params = load_params(ROOT / "params.yaml", [*TINY, f"data.root={glyph_root}", "tracking.enabled=true"])
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
    registry = Registry(params)  # as the pipeline: a second version for the reviewer to choose
    first = registry.get(1)
    # The same logged model as v1 (its checkpoint's sha256, as a new server checks it before serving).
    second = registry.create(first.source, {"model_sha256": first.tags["model_sha256"], "decision": "held"}).version
    user = as_account(monkeypatch, "reviewer")
    promote = ["registry", "--params", str(path), "promote", "--model-version", str(second), "--reason", "checked by hand"]
    assert main(promote) == 1  # no index attached: it could not serve, so it is refused before any write
    assert f"xbn index --model-version {second}" in capsys.readouterr().err
    as_account(monkeypatch, "pipeline")  # the same logged model as v1, so v1's index is its index
    registry.set_tags(second, {INDEX_SHA_TAG: first.tags[INDEX_SHA_TAG]})
    as_account(monkeypatch, "reviewer")
    code = main(promote)
    assert code == 0, capsys.readouterr().err
    tags = MlflowClient(mlflow_server.url).get_model_version(MODEL_NAME, str(second)).tags
    assert tags["decided_by"] == user == "alice"  # the authenticated account, not $USER
    assert main(["registry", "--params", str(path), "promote", "--model-version", "1", "--reason", "as me", "--user",
                 "mallory"]) == 1  # a --user that is not the account is refused
    assert main(["registry", "--params", str(path), "rollback", "--reason", "back to v1"]) == 0
    capsys.readouterr()

    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-the-password")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    assert main(["registry", "--params", str(path), "review"]) == EXIT_CONFIG
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("xbn registry: the MLflow server did not accept the account 'alice'")
    as_account(monkeypatch, "reader")
    assert main(["registry", "--params", str(path), "promote", "--model-version", str(second), "--reason", "r"]) == \
        EXIT_CONFIG
    err = capsys.readouterr().err.strip()
    assert "the MLflow account 'xbn-serve' may not do that" in err and "needs EDIT" in err, err


def test_a_host_rollback_waits_for_a_worker_on_the_store_and_is_refused_without_the_shared_lock(
        mlflow_server, registered, client_env, monkeypatch, tmp_path, capsys, glyph_root):
    """Issue 54: two registry writers whose tracking URIs differ, a worker on the PostgreSQL store itself and a
    reviewer on the host through the server, exclude each other when the host names the store as its lock
    (`$XBN_LOCK_URI`); without it the host's write is refused in one line, not left to a machine-local lock.
    The worker is held inside its registry lock at a fault point; the host's rollback is seen waiting on it in
    pg_locks, then restores the champion the worker replaced."""
    import time

    import yaml

    from xbn.cli import EXIT_CONFIG, main
    from xbn.config import load_params
    from xbn.tracking import Registry
    from xbn.tracking.history import read_history
    from xbn.utils.faults import FAULT_DIR_ENV, FAULT_ENV

    params = load_params(ROOT / "params.yaml", [*TINY, f"data.root={glyph_root}", "tracking.enabled=true",
                                                "registry.promote_with_index=false"])
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
    registry = Registry(params)
    before = registry.by_alias("champion").version
    new = registry.create(registry.get(1).source, {"model_sha256": "e" * 64, "decision": "held"}).version
    as_account(monkeypatch, "reviewer")
    rollback = ["registry", "--params", str(path), "rollback", "--reason", "the host's rollback"]

    monkeypatch.delenv("XBN_LOCK_URI")
    capsys.readouterr()  # MLflow's own lines about the version just created
    assert main(rollback) == EXIT_CONFIG
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "set $XBN_LOCK_URI (or tracking.lock_uri)" in err, err

    xbn = str(Path(sys.executable).with_name("xbn"))
    worker_env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_USERNAME",
                                                                   "MLFLOW_TRACKING_PASSWORD")}
    worker_env |= {"MLFLOW_TRACKING_URI": mlflow_server.store, FAULT_ENV: "promotion.after_history:wait",
                   FAULT_DIR_ENV: str(tmp_path)}
    worker = subprocess.Popen([xbn, "registry", "--params", str(path), "promote", "--model-version", str(new),
                               "--reason", "the worker's promotion", "--user", "worker"],
                              env=worker_env, stderr=subprocess.PIPE, text=True)
    host = None
    try:
        reached, deadline = tmp_path / "promotion.after_history.reached", time.monotonic() + 120
        while not reached.exists():
            assert worker.poll() is None and time.monotonic() < deadline, worker.stderr.read()
            time.sleep(0.1)
        host = subprocess.Popen([xbn, *rollback], env={**os.environ, "XBN_LOCK_URI": mlflow_server.store},
                                stderr=subprocess.PIPE, text=True)
        waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        while admin_execute(waiting, dbname=mlflow_server.database)[0][0] == 0:
            assert host.poll() is None, f"the host did not wait: {host.stderr.read()}"
            assert time.monotonic() < deadline + 60
            time.sleep(0.1)
        assert registry.by_alias("champion").version == before  # the worker's move is not done yet
        (tmp_path / "promotion.after_history.release").touch()
        assert worker.wait(timeout=120) == 0, worker.stderr.read()
        assert host.wait(timeout=120) == 0, host.stderr.read()
    finally:
        for proc in (worker, host):
            if proc is not None and proc.poll() is None:
                proc.kill()
    # One after the other: the worker's promotion, then the host's rollback of it, to the champion it replaced.
    last = read_history(registry)[-2:]
    assert [(e.action, e.from_version, e.to_version) for e in last] == [("promote", before, new),
                                                                       ("rollback", new, before)]
    assert last[1].undoes == last[0].seq and registry.by_alias("champion").version == before
