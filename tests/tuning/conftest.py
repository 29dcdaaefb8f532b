"""Fixtures for the tuning tests: a tiny prepared project in tmp_path with a real MLflow store, and a real
PostgreSQL database per test (created and dropped here)."""

from __future__ import annotations

import os
import secrets
import shutil

import mlflow
import pytest

from tests_support import ROOT, TINY

# One epoch per trial, no warm-up: a trial takes about two seconds on a CPU. A beat every second, and a dead
# worker's trial failed after 15 s without one: a 2 s grace failed a live worker's trial in make test (its
# heartbeat thread starved beside three xdist workers on two cores).
TUNE_TINY = ["train.warmup_epochs=0", "tune.epochs=1", "tune.pruner_startup_trials=1",
             "tune.heartbeat_interval=1", "tune.grace_period=15"]
POSTGRES_ADMIN = os.environ.get("XBN_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")


@pytest.fixture
def project(tmp_path, glyph_root, monkeypatch, mlflow_store_template):
    """`make(*overrides) -> Params` for tiny trials in tmp_path (the working directory), data prepared."""
    from xbn.config import load_params
    from xbn.stages.prepare import prepare

    monkeypatch.chdir(tmp_path)
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "XBN_PARENT_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    shutil.copy(mlflow_store_template, tmp_path / "mlflow.db")

    def make(*overrides: str):
        store = f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"
        return load_params(ROOT / "params.yaml", [*TINY, f"data.root={glyph_root}", "tracking.enabled=true",
                                                  store, *TUNE_TINY, *overrides])

    prepare(make())
    yield make
    while mlflow.active_run():
        mlflow.end_run()


@pytest.fixture
def postgres_url():
    """A fresh database on the PostgreSQL at 127.0.0.1:5432, dropped afterwards. Skipped with the reason when
    the server cannot be reached, unless CI=true (then it fails: CI runs next to the server)."""
    import psycopg2
    from sqlalchemy.engine import make_url

    admin = make_url(POSTGRES_ADMIN)
    connect = dict(host=admin.host, port=admin.port or 5432, user=admin.username, password=admin.password)
    try:
        conn = psycopg2.connect(dbname=admin.database, connect_timeout=3, **connect)
    except psycopg2.OperationalError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL at {admin.host}:{admin.port} is unreachable and CI=true: {exc}")
        pytest.skip(f"PostgreSQL at {admin.host}:{admin.port} is unreachable: {str(exc).strip()}")
    name = f"xbn_optuna_test_{secrets.token_hex(4)}"
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    try:
        yield admin.set(drivername="postgresql+psycopg2", database=name).render_as_string(hide_password=False)
    finally:
        with conn.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()
