"""Fixtures for the tracking tests: a real SQLite MLflow store per test (migrated once per session, then
copied) and a working directory laid out like the project's."""

from __future__ import annotations

import shutil

import mlflow
import pytest

from xbn.config import Params
from xbn.tracking import PARENT_RUN_ENV

from .helpers import write_manifest


@pytest.fixture
def params(tmp_path, monkeypatch, mlflow_store_template) -> Params:
    """Params for a tiny model and a store in tmp_path, with tmp_path as the working directory."""
    monkeypatch.chdir(tmp_path)
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_NAME",
                "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID", PARENT_RUN_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("USER", "tester")
    shutil.copy(mlflow_store_template, tmp_path / "mlflow.db")
    write_manifest(tmp_path / "data/manifest.csv", "v1")
    yield Params.model_validate({
        "data": {"root": "data/images", "image_size": 32, "num_workers": 0},
        "model": {"backbone": "test_resnet", "pretrained": "none", "embedding_dim": 8},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        # The gate's tests: the champion moves at the decision; test_promote_last.py covers the index first.
        "registry": {"promote_with_index": False},
    })
    while mlflow.active_run():  # a failed assertion inside a run must not leak it into the next test
        mlflow.end_run()


@pytest.fixture
def served(params) -> Params:
    """The shipped setting: promote_with_index true (the tracking tests' fixture turns it off)."""
    return Params.model_validate({**params.model_dump(), "registry": {**params.registry.model_dump(),
                                                                     "promote_with_index": True}})
