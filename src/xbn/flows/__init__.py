"""Prefect flows over xbn's stages (the same functions `dvc repro` runs through the CLI): `retrain` (the weekly
schedule), `catalogue` (the catalogue on Dask) and `tune` (an Optuna study). prefect.yaml's entrypoints are the
thin files in the project's pipelines/ folder, which import them from here."""

import contextlib
import os
from collections.abc import Iterator

from xbn.utils.errors import ServiceUnavailableError

# Before Prefect is imported by any flow module:
# - its ephemeral server's analytics print a "database is locked" traceback per run;
# - that server takes about 14 s to start on an idle 2-core machine and Prefect waits 20 s for it, so a run beside
#   a training died with "Timed out while attempting to connect to ephemeral Prefect API server". A user's own
#   setting (or PREFECT_API_URL, which needs no ephemeral server) is kept.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")


@contextlib.contextmanager
def prefect_api() -> Iterator[None]:
    """Around a flow call: an ephemeral Prefect API that did not start in time (a busy machine) is one line naming
    the ways out (exit 4, as any service the run needs), not Prefect's traceback."""
    limit = os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "?")
    try:
        _start_ephemeral_api()
        yield
    except RuntimeError as exc:
        if "ephemeral Prefect API server" not in str(exc):
            raise
        raise ServiceUnavailableError(
            f"the Prefect API did not start: Prefect's ephemeral server was not up within {limit} s (a busy "
            "machine?). Set PREFECT_API_URL to a running Prefect server (`prefect server start`, or the compose "
            "stack's: infra/README.md), or raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS") from None


def _start_ephemeral_api() -> None:
    """Start Prefect's ephemeral API server now, one process at a time per PREFECT_HOME, when the flow would start
    one (no PREFECT_API_URL). Two runs that start it at once race the database's migration: the loser's server
    fails its start-up with "no such table" and a traceback, and Prefect starts another (seen with two `xbn
    retrain` under load, tests/pipeline/test_two_runs.py). The flow then finds this one running (Prefect keeps one
    per process). Written by hand: Prefect serialises the migration only between threads of one process."""
    from filelock import FileLock, Timeout
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, PREFECT_SERVER_EPHEMERAL_ENABLED
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as STARTUP_S

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    home = PREFECT_HOME.value()
    home.mkdir(parents=True, exist_ok=True)
    try:  # the other start's whole time, and then this one's own
        with FileLock(home / ".xbn-ephemeral-start.lock", timeout=2 * STARTUP_S.value()):
            SubprocessASGIServer().start()
    except Timeout:
        raise RuntimeError("Timed out while waiting for another process's ephemeral Prefect API server to start "
                           f"from {home}") from None
