"""Helpers for the infra tests: the services of infra/compose.yaml run natively on loopback (Docker cannot run
on the project's machines). PostgreSQL is the local server at 127.0.0.1:5432 (trust auth, user postgres)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tests_support import free_port  # noqa: F401 - the infra tests import it from here

PG_HOST, PG_PORT, PG_USER = "127.0.0.1", 5432, "postgres"


def require_postgres() -> None:
    """Skip when PostgreSQL is unreachable, except in CI (CI=true), where these tests must run."""
    import psycopg2

    try:
        psycopg2.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, dbname="postgres",
                         connect_timeout=3).close()
    except psycopg2.OperationalError as exc:
        message = f"PostgreSQL is not reachable at {PG_HOST}:{PG_PORT} as {PG_USER}: {exc}".strip()
        if os.environ.get("CI") == "true":
            pytest.fail(message + " (CI=true: the infra tests must run)")
        pytest.skip(message)


def admin_execute(*statements: str, dbname: str = "postgres") -> list[tuple]:
    """Run statements as the postgres superuser (autocommit); returns the last one's rows, if any."""
    import psycopg2

    conn = psycopg2.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=dbname, connect_timeout=5)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            rows: list[tuple] = []
            for statement in statements:
                cur.execute(statement)
                rows = cur.fetchall() if cur.description else []
            return rows
    finally:
        conn.close()


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Poll `url` until it answers 200; fail with the server's log if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode} before {url} answered:\n{tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    pytest.fail(f"{url} did not answer within {timeout:.0f} s:\n{tail(log)}")


def stop(proc: subprocess.Popen, grace: float = 5) -> None:
    """Stop a server started with start_new_session=True: SIGTERM to its process group (the server and the
    workers it forked), SIGKILL to what is left after `grace` seconds."""
    import signal

    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return  # the whole group is gone
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        time.sleep(0.2)  # the leader is gone; give forked workers a moment before checking the group


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def env_example() -> dict[str, str]:
    """infra/.env.example as a dict (KEY=VALUE lines; comments and blank lines skipped)."""
    from tests_support import ROOT

    values = {}
    for line in (ROOT / "infra/.env.example").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


# The Prefect server keeps its concurrency leases on disk (compose, and the fault suite, which restarts a server).
LEASE_STORAGE = "prefect.server.concurrency.lease_storage.filesystem"


def api(url: str, path: str, body: dict | None = None, auth: str | None = None,
        method: str | None = None) -> tuple[int, object]:
    request = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                     method=method or ("GET" if body is None else "POST"),
                                     headers={"Content-Type": "application/json"})
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None


def stop_worker(worker: subprocess.Popen, grace: float = 5) -> None:
    """Stop the worker's process group, then any flow-run process it started (they run in their own session)."""
    import psutil

    try:
        children = psutil.Process(worker.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    stop(worker, grace)
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
