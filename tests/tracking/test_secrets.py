"""Credentials never reach the logs or the MLflow params: URIs with a password are recorded masked."""

from __future__ import annotations

import logging
import traceback
import os

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


@pytest.fixture
def half_server():
    """A real socket that answers /health and drops every other request unanswered: the MLflow store reachable,
    then failing mid-call (a proxy restarting, a server killed between two requests)."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                if b" /health" in conn.recv(65536).split(b"\r\n")[0]:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nOK")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join()
    listener.close()


def test_an_mlflow_call_failing_with_the_password_in_its_url_prints_it_masked(half_server, tmp_path, monkeypatch,
                                                                             capsys):
    """Issue 54 item 7: MLflow's own message names the URL it called, password included; the command printed it in
    a traceback. Now the account leaves the URI as it is read, the failure is one line with exit 4 (a service),
    and any traceback xbn has no name for is printed masked."""
    from xbn.cli import main
    from xbn.utils.errors import EXIT_FAILURE, EXIT_SERVICE

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://xbn:{SECRET}@127.0.0.1:{half_server}/")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    assert main(["registry", "review", "--set", "tracking.outage_s=0"]) == EXIT_SERVICE
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err
    # The account went to the environment as the URI was read, so MLflow's message names the URL without it.
    assert "failed a request" in out.err and f"API request to http://127.0.0.1:{half_server}/api/" in out.err

    def fails(*args, **kwargs):
        raise RuntimeError(f"nothing xbn names, at postgresql://xbn:{SECRET}@db/mlflow")

    monkeypatch.setattr("xbn.cli.summary_text", fails)
    assert main(["summary", "--set", "tracking.enabled=false"]) == EXIT_FAILURE
    err = capsys.readouterr().err
    assert "Traceback" in err and "postgresql://xbn:***@db/mlflow" in err and SECRET not in err


def test_a_server_uri_gives_its_account_to_the_environment_unless_one_is_set(monkeypatch):
    from xbn.tracking.services import account_to_environment

    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    assert account_to_environment(f"https://xbn:{SECRET}%40x@mlflow.example.com:443/") == \
        "https://mlflow.example.com:443/"
    assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]) == ("xbn", f"{SECRET}@x")
    # One set already wins, as it does in MLflow's client; the URI still loses its account.
    assert account_to_environment("http://other:pw@h:5000") == "http://h:5000"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "xbn"
    for uri in ("http://h:5000", "sqlite:///m.db", f"postgresql://xbn:{SECRET}@db/mlflow"):
        assert account_to_environment(uri) == uri  # libpq reads PGPASSWORD; the DSN is masked where written


def test_an_exception_is_masked_in_place_with_every_one_it_came_from():
    """What Prefect records of a failed task (its state's message, the traceback its engine sends to the API) is
    read from the exception: it leaves every xbn task and flow masked, its type and chain kept."""
    from mlflow.exceptions import MlflowException

    from xbn.utils.secrets import masks_exceptions

    @masks_exceptions
    def call_the_store():
        try:
            raise ConnectionError(f"connecting to postgresql://xbn:{SECRET}@db/mlflow")
        except ConnectionError as exc:
            error = MlflowException(f"API request to http://xbn:{SECRET}@mlflow:5000/api failed")
            error.add_note(f"while logging to http://xbn:{SECRET}@mlflow:5000")
            raise error from exc

    with pytest.raises(MlflowException) as raised:
        call_the_store()
    shown = "".join(traceback.format_exception(raised.value))
    assert SECRET not in shown and "http://xbn:***@mlflow:5000/api" in shown and "postgresql://xbn:***@db" in shown
    assert isinstance(raised.value.__cause__, ConnectionError) and call_the_store.__name__ == "call_the_store"


def test_every_task_and_flow_of_xbn_masks_what_it_raises():
    import prefect

    import xbn.flows.catalogue
    import xbn.flows.retrain
    import xbn.flows.tune
    from xbn.utils.secrets import masks_exceptions

    masked_code = masks_exceptions(lambda: None).__code__
    found = {f"{module.__name__}.{name}": getattr(obj.fn, "__code__", None) is masked_code
             for module in (xbn.flows.catalogue, xbn.flows.retrain, xbn.flows.tune)
             for name, obj in vars(module).items()
             if isinstance(obj, (prefect.Task, prefect.Flow)) and obj.fn.__module__ == module.__name__}
    assert len(found) >= 20 and all(found.values()), [name for name, masked in found.items() if not masked]


def test_a_masked_flow_still_validates_its_parameters():
    """Prefect validates a flow's parameters from its signature: under the mask, the annotations (postponed, so
    strings) must still resolve in the flow's own module (`Shard` is not a name of xbn.utils.secrets)."""
    from xbn.flows.catalogue import embed_shards

    checked = embed_shards.validate_parameters({"params_path": "params.yaml", "overrides": [], "version": "3",
                                                "shards": []})
    assert checked["version"] == 3
