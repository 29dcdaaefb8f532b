"""Credentials never reach the logs or the MLflow params: URIs with a password are recorded masked."""

from __future__ import annotations

import logging

import pytest
import yaml
from mlflow.tracking import MlflowClient
from tests_support import ROOT

from xbn.config import flatten, load_params
from xbn.tracking import pipeline_run
from xbn.tracking.services import has_password, mask_secrets, redact

SECRET = "s3cr3t-pw"


@pytest.mark.parametrize("text, masked", [
    (f"postgresql://xbn:{SECRET}@db:5432/optuna", "postgresql://xbn:***@db:5432/optuna"),
    (f"postgresql+psycopg2://u:{SECRET}@h/db", "postgresql+psycopg2://u:***@h/db"),
    (f"https://user:{SECRET}@mlflow.example.com", "https://user:***@mlflow.example.com"),
    (f"host=db user=u password={SECRET} dbname=x", "host=db user=u password=*** dbname=x"),
    ("postgresql://xbn@db/optuna", "postgresql://xbn@db/optuna"),  # no password: unchanged
    ("sqlite:///mlflow.db", "sqlite:///mlflow.db"),
    ("journal:tuning/optuna.journal", "journal:tuning/optuna.journal"),
    # Issue 41: what the mask missed
    (f"postgresql://u:p@{SECRET}/x@db:5432/mlflow", "postgresql://u:***@db:5432/mlflow"),  # '@' in a password
    (f"AWS_SECRET_ACCESS_KEY={SECRET} aws_secret_access_key={SECRET}",
     "AWS_SECRET_ACCESS_KEY=*** aws_secret_access_key=***"),
    (f"https://api.example.com/x?apikey={SECRET}&api_key={SECRET}&access_token={SECRET}&q=1",
     "https://api.example.com/x?apikey=***&api_key=***&access_token=***&q=1"),
    (f"https://b.s3.amazonaws.com/k?X-Amz-Credential={SECRET}&X-Amz-Signature={SECRET}&X-Amz-Expires=60",
     "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Expires=60"),
    ("https://example.com/a?page=2", "https://example.com/a?page=2"),
])
def test_mask_secrets(text, masked):
    assert mask_secrets(text) == masked
    assert SECRET not in str(redact({"a": [text, (text,)]}))


def test_the_shipped_params_hold_no_credential():
    flat = flatten(load_params(ROOT / "params.yaml"))
    assert not [k for k, v in flat.items() if isinstance(v, str) and has_password(v)]
    assert SECRET not in yaml.safe_dump(flat)


def test_a_run_logs_uris_with_their_password_masked(params, caplog):
    params.tune.storage = f"postgresql://xbn:{SECRET}@db.internal:5432/optuna"
    with caplog.at_level(logging.INFO):
        with pipeline_run(params, "train", new=True) as run:
            pass
    logged = MlflowClient(params.tracking.uri).get_run(run.run_id).data.params
    assert logged["tune.storage"] == "postgresql://xbn:***@db.internal:5432/optuna"
    assert not [k for k, v in logged.items() if SECRET in v]
    assert SECRET not in caplog.text


def test_a_checkpoint_records_the_params_masked(params):
    """A checkpoint travels with its registered version (any registry reader downloads it): its params record
    (`_provenance`) and the flat one the resume check reads (`params_record`) hold no password."""
    from types import SimpleNamespace

    from xbn.training.trainer import Trainer, params_record

    params.tune.storage = f"postgresql://xbn:{SECRET}@db.internal:5432/optuna"
    recorded = Trainer._provenance(SimpleNamespace(params=params, init_record=None))
    assert recorded["params"]["tune"]["storage"] == "postgresql://xbn:***@db.internal:5432/optuna"
    assert SECRET not in str(recorded) and SECRET not in str(params_record(params))


def test_an_error_is_written_masked_to_the_stage_record(params, tmp_path):
    from xbn.config.record import read_record, write_record

    error = f"OperationalError: could not connect to postgresql://xbn:{SECRET}@db:5432/mlflow"
    write_record(params, "train", "failed", None, None, record_path=tmp_path / "record.yaml", reason=error)
    assert read_record(tmp_path / "record.yaml")["stages"]["train"]["reason"] == \
        "OperationalError: could not connect to postgresql://xbn:***@db:5432/mlflow"
