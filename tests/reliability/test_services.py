"""Services down: an unreachable tracking store stops `xbn train` and the retrain flow in seconds, before any
training, with a message naming the store; transient errors while a run logs are retried."""

from __future__ import annotations

import base64
import http.server
import logging
import socket
import threading
import time
from pathlib import Path

import pytest
from tests_support import free_port

from xbn.cli import EXIT_SERVICE, main
from xbn.tracking.services import Retrying, check_reachable, retry, wait_reachable
from xbn.utils.errors import ServiceUnavailableError


@pytest.fixture(autouse=True)
def _no_env_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.mark.parametrize("uri", [
    "http://127.0.0.1:{port}",
    "postgresql://postgres:not-the-password@127.0.0.1:{port}/postgres",
], ids=["server", "postgresql"])
def test_train_fails_fast_naming_the_unreachable_store(params_file, capsys, uri):
    uri = uri.format(port=free_port())
    params = params_file("tracking.enabled=true", f"tracking.uri={uri}")
    start = time.monotonic()
    code = main(["train", "--params", str(params), "-q"])
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == EXIT_SERVICE, err
    assert "not reachable" in err and uri.split("@")[-1] in err
    assert "not-the-password" not in err  # the URI is named with its password masked
    assert elapsed < 20  # a refused connection, not MLflow's minutes of HTTP retries
    assert not Path("models").exists() and not Path("metrics").exists()


def test_retrain_flow_checks_the_store_before_any_task(params_file):
    from xbn.flows.retrain import retrain

    uri = f"http://127.0.0.1:{free_port()}"
    params = params_file("tracking.enabled=true", f"tracking.uri={uri}")
    with pytest.raises(ServiceUnavailableError, match=uri):
        retrain.fn(str(params))  # the flow's body: the check runs before prepare
    assert not Path("data/manifest.csv").exists()


def test_a_reachable_sqlite_store_passes_and_a_missing_directory_does_not(tmp_path):
    check_reachable(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with pytest.raises(ServiceUnavailableError, match="nowhere"):
        check_reachable(f"sqlite:///{tmp_path / 'nowhere/mlflow.db'}")


def test_transient_errors_are_retried_with_backoff_and_others_are_not(caplog):
    calls = []

    def flaky(value):
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise ConnectionError("connection reset by peer")
        return value

    with caplog.at_level(logging.WARNING):
        assert retry(flaky, 7, base_delay=0.05) == 7
    assert len(calls) == 3 and calls[2] - calls[1] > calls[1] - calls[0] > 0.04  # backoff grows
    assert caplog.text.count("retry") == 2

    def broken():
        calls.append(0)
        raise ValueError("a bug, not a blip")

    calls.clear()
    with pytest.raises(ValueError):
        retry(broken, base_delay=0.01)
    assert len(calls) == 1
    with pytest.raises(ConnectionError):  # still down after the last attempt: the error surfaces
        Retrying(socket, attempts=2, base_delay=0.01).create_connection(("127.0.0.1", free_port()), 1)


def test_epoch_logging_survives_a_store_that_went_down(monkeypatch, caplog):
    from xbn.tracking import PipelineRun, epoch_logger

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retries: minutes
    uri = f"http://127.0.0.1:{free_port()}"
    run = PipelineRun("0" * 32, "0", uri, "", resumed=False)
    log_epoch = epoch_logger(run)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        log_epoch(1, {"epoch": 1, "loss": 0.5})  # the training goes on
    assert "epoch 1 metrics not logged" in caplog.text and caplog.text.count("retry") == 3
    assert time.monotonic() - start < 30


PASSWORD = "secret"  # named once: a traceback that prints a test's source line must not show it


class _Health(http.server.BaseHTTPRequestHandler):
    seen: list[tuple[str, str | None]] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        _Health.seen.append((self.path, self.headers.get("Authorization")))
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"OK")

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Health.seen.clear()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_server_uri_with_user_and_password_is_reachable_and_the_password_never_printed(
        health_server, caplog, capsys):
    uri = f"http://user:{PASSWORD}@127.0.0.1:{health_server}/"
    with caplog.at_level(logging.DEBUG):
        check_reachable(uri)
    # The credentials go as basic auth, not in the request line; the URI is logged masked.
    assert _Health.seen == [("/health", "Basic " + base64.b64encode(f"user:{PASSWORD}".encode()).decode())]
    out = capsys.readouterr()
    assert PASSWORD not in caplog.text + out.out + out.err
    assert "user:***@127.0.0.1" in caplog.text  # the warning to move the password to the environment


def test_cli_names_a_server_with_credentials_without_its_password(params_file, capsys):
    # The same URI whose server is down: exit 4 naming it, masked, and no password anywhere in the output.
    uri = f"http://user:{PASSWORD}@127.0.0.1:{free_port()}"
    params = params_file("tracking.enabled=true", f"tracking.uri={uri}")
    assert main(["train", "--params", str(params), "-q"]) == EXIT_SERVICE
    out = capsys.readouterr()
    assert PASSWORD not in out.out + out.err and "user:***@127.0.0.1" in out.err


def test_a_store_that_blinks_is_waited_for_and_one_that_stays_down_is_named_after_the_wait(caplog):
    # Issue 40: MLflow down for a moment mid-register failed the whole week (ServiceUnavailableError is not
    # retried). A real server that comes up after the first attempt, bound on the port the check was refused on.
    port = free_port()
    server = None

    def start_later():
        nonlocal server
        time.sleep(1.5)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Health)
        server.serve_forever()

    threading.Thread(target=start_later, daemon=True).start()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        wait_reachable(f"http://127.0.0.1:{port}", wait_s=30)
    assert time.monotonic() - start < 20 and "trying again in" in caplog.text
    server.shutdown()
    server.server_close()

    start = time.monotonic()
    with pytest.raises(ServiceUnavailableError, match=r"still down after waiting 2 s: tracking.outage_s"):
        wait_reachable(f"http://127.0.0.1:{free_port()}", wait_s=2)
    assert 1.9 < time.monotonic() - start < 10
