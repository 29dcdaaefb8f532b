"""The tracking store as a service: is it reachable (checked before training, so a run fails in seconds,
not after hours), retries of transient errors while a run logs, and credentials kept out of logs and params.

Credentials belong in the environment, not in params.yaml: libpq reads `PGPASSWORD` (or ~/.pgpass) for a
`postgresql://user@host/db` URI, MLflow reads `MLFLOW_TRACKING_USERNAME`/`MLFLOW_TRACKING_PASSWORD` for a
server. A URI that still embeds a password is masked (`***`) wherever xbn logs or records it.
"""

from __future__ import annotations

import base64
import logging
import os
import random
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse, urlsplit, urlunsplit

from xbn.utils.errors import ServiceUnavailableError
from xbn.utils.secrets import _DATABASE_SCHEMES, MASK, mask_secrets, mask_values  # noqa: F401 - re-exported

log = logging.getLogger(__name__)
T = TypeVar("T")

redact = mask_values  # every string in a value masked (xbn.utils.secrets)


def has_password(uri: str) -> bool:
    return mask_secrets(uri) != uri


_WARNED: set[str] = set()  # the masked URIs whose embedded account was already reported


def account_to_environment(uri: str) -> str:
    """A server URI that embeds its account (`https://user:pw@host`), without it; the account goes to
    MLFLOW_TRACKING_USERNAME/PASSWORD (this process and those it starts), which MLflow's client reads, unless
    they are set already (MLflow's client lets them win over the URI's). MLflow's own messages name the URL
    they called (`API request to <url> failed`), so a password left in the URI reached every traceback, log
    line and flow-run state quoting them. Other URIs are returned as they are (libpq reads PGPASSWORD, and a
    database URI's password is masked wherever xbn writes it)."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or parts.password is None:
        return uri
    if (shown := mask_secrets(uri)) not in _WARNED:  # once per process: the URI is read at every stage
        _WARNED.add(shown)
        log.warning("tracking URI %s embeds a password: set it in the environment instead "
                    "(MLFLOW_TRACKING_PASSWORD); xbn moved it there for this run", shown)
    if "MLFLOW_TRACKING_USERNAME" not in os.environ:
        os.environ["MLFLOW_TRACKING_USERNAME"] = unquote(parts.username or "")
        os.environ["MLFLOW_TRACKING_PASSWORD"] = unquote(parts.password)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """Raise `ServiceUnavailableError` naming `uri` (masked) unless the tracking store answers: a server's
    `/health`, a database a connection; a SQLite file needs its directory to exist."""
    shown = mask_secrets(uri)
    if has_password(uri):
        log.warning("tracking URI %s embeds a password: set it in the environment instead (PGPASSWORD, "
                    "MLFLOW_TRACKING_PASSWORD)", shown)
    scheme = urlparse(uri).scheme.split("+")[0]
    try:
        if scheme in ("http", "https"):
            with urllib.request.urlopen(health_request(uri), timeout=timeout) as response:
                if response.status != 200:
                    raise OSError(f"/health answered HTTP {response.status}")
        elif scheme in _DATABASE_SCHEMES:
            import sqlalchemy as sa

            args = {"connect_timeout": max(1, int(timeout))} if scheme.startswith("postgres") else {}
            engine = sa.create_engine(uri, poolclass=sa.pool.NullPool, connect_args=args)
            try:
                with engine.connect() as conn:
                    conn.execute(sa.text("SELECT 1"))
            finally:
                engine.dispose()
        elif scheme == "sqlite":
            from pathlib import Path

            db = uri.split(":///", 1)[1] if ":///" in uri else ""
            if db and db != ":memory:" and not Path(db).resolve().parent.is_dir():
                raise OSError(f"directory {Path(db).resolve().parent} does not exist")
    except Exception as exc:  # noqa: BLE001 - urllib, socket and every DB driver raise their own types
        reason = mask_secrets(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        raise ServiceUnavailableError(
            f"the MLflow tracking store {shown} is not reachable ({reason}); start it, or point "
            f"MLFLOW_TRACKING_URI / tracking.uri at one that is (tracking.enabled=false runs without it)"
        ) from None


def wait_reachable(uri: str, wait_s: float, timeout: float = 5.0) -> None:
    """`check_reachable`, tried again with backoff (1, 2, 4... 15 s) for up to `wait_s` seconds
    (`tracking.outage_s`): a store that blinks in the middle of a run (a server restarted, a database failing
    over) is waited for, not turned into a failed week. Past it, the error names the store and the wait."""
    deadline, delay = time.monotonic() + wait_s, 1.0
    while True:
        try:
            return check_reachable(uri, timeout)
        except ServiceUnavailableError as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                if wait_s <= 0:
                    raise
                raise ServiceUnavailableError(f"{exc} (still down after waiting {wait_s:g} s: "
                                              "tracking.outage_s)") from None
            pause = min(delay, left)
            log.warning("%s; trying again in %.0f s (%.0f s left of tracking.outage_s)", exc, pause, left)
            time.sleep(pause)
            delay = min(2 * delay, 15.0)


# What an endpoint of MLflow's REST API needs under its basic-auth app (mlflow.server.auth): reads READ, writes
# EDIT, deletes MANAGE; permissions are per experiment and per registered model.
_NEEDED = (("delete", "MANAGE"), ("/get", "READ"), ("search", "READ"), ("list", "READ"), ("download", "READ"))


def access_denied(exc: BaseException) -> str | None:
    """One line for an MLflow 401/403 (an unknown or wrong account, a missing permission), naming the account
    and the permission the request needed; None for any other error. Never a traceback for these: they are
    the caller's settings, not a bug."""
    from mlflow.exceptions import MlflowException

    if not isinstance(exc, MlflowException) or exc.error_code not in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return None
    account = os.environ.get("MLFLOW_TRACKING_USERNAME") or "(none: MLFLOW_TRACKING_USERNAME is not set)"
    found = re.search(r"endpoint (\S+) failed", str(exc))
    endpoint = found[1] if found else "an endpoint"
    if exc.error_code == "UNAUTHENTICATED":
        return (f"the MLflow server did not accept the account {account!r} at {endpoint}: set "
                "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to an account of that server")
    needed = next((p for part, p in _NEEDED if part in endpoint), "EDIT")
    return (f"the MLflow account {account!r} may not do that: {endpoint} needs {needed} permission on the "
            "experiment or registered model; ask an MLflow admin to grant it (infra/README.md, accounts)")


def health_request(uri: str) -> urllib.request.Request:
    """GET <server>/health with any `user:password@` of the URI taken out of the address (urllib would read it
    as part of the host name) and sent as HTTP basic auth instead, as MLflow's client does; without one,
    MLFLOW_TRACKING_USERNAME/PASSWORD are sent when set."""
    parts = urlsplit(uri)
    url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])).rstrip("/") + "/health"
    request = urllib.request.Request(url)
    user: str | None
    password: str | None
    if parts.username is not None:
        user, password = unquote(parts.username), unquote(parts.password or "")
    else:
        user, password = (os.environ.get(f"MLFLOW_TRACKING_{k}") for k in ("USERNAME", "PASSWORD"))
    if user:
        token = base64.b64encode(f"{user}:{password or ''}".encode()).decode("ascii")
        request.add_unredirected_header("Authorization", f"Basic {token}")
    return request


def is_transient(exc: BaseException) -> bool:
    """Errors worth retrying: the network, a busy or restarting server or database."""
    from mlflow.exceptions import MlflowException

    if isinstance(exc, (ConnectionError, TimeoutError, urllib.error.URLError)):
        return True
    if isinstance(exc, MlflowException):
        code = getattr(exc, "error_code", "")
        return code in ("TEMPORARILY_UNAVAILABLE", "INTERNAL_ERROR", "REQUEST_LIMIT_EXCEEDED",
                        "DEADLINE_EXCEEDED", "ABORTED") or "database is locked" in str(exc)
    try:
        import requests
        import sqlalchemy.exc as sa_exc
    except ImportError:  # pragma: no cover - both come with mlflow
        return False
    return isinstance(exc, (requests.ConnectionError, requests.Timeout, sa_exc.OperationalError))


def retry(fn: Callable[..., T], *args: Any, attempts: int = 4, base_delay: float = 0.5,
          what: str | None = None, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, retried on transient errors with exponential backoff and jitter (0.5, 1, 2 s
    by default); the last error is raised. Only for idempotent calls (logging a batch twice is harmless)."""
    for attempt in range(1, attempts + 1):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if attempt == attempts or not is_transient(exc):
                raise
            delay = base_delay * 2 ** (attempt - 1) * (1 + random.random() / 2)
            log.warning("%s failed (%s: %s); retry %d/%d in %.1f s", what or getattr(fn, "__name__", "call"),
                        type(exc).__name__, mask_secrets(str(exc))[:300], attempt, attempts - 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


class Retrying:
    """A proxy whose method calls go through `retry`: `Retrying(MlflowClient(uri)).log_batch(...)`."""

    def __init__(self, target: Any, **options: Any) -> None:
        self._target, self._options = target, options

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr
        return lambda *args, **kwargs: retry(attr, *args, what=f"MLflow {name}", **self._options, **kwargs)
