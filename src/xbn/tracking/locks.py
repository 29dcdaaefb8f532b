"""A lock around the registry's decide-and-move-alias step, so concurrent `register`/`promote`/`rollback`
runs against one tracking store act one after the other: each one reads the champion the previous one left.

The lock lives where the store is:
- a SQLite store: a file lock next to the database file (`<db>.registry.lock`);
- a database store (PostgreSQL): a session-level advisory lock (`pg_advisory_lock`) on the same database,
  keyed by the registered model's name, held on its own connection and released when that connection ends
  (so a killed holder never leaves it stuck);
- a tracking server (http): the server offers no lock, so the lock is an advisory lock in the PostgreSQL that
  `$XBN_LOCK_URI` (or else `tracking.lock_uri`) names, shared by every container, machine and host command;
  without one a registry writer is refused (`ConfigError`, exit 2): a machine-local lock would let a reviewer's
  rollback on the host interleave with a worker's register.
A lock URI, when set, holds the locks whatever the store, so a worker on the PostgreSQL store and one through
the server exclude each other when both name that database (or the server one names the store's).

`run_lock` is the same kind of lock around a whole pipeline execution (the retrain flow, `xbn retrain`,
`xbn run`, `xbn register`), so that two runs on one registered model never interleave, whatever started them;
re-entered by the same process (`xbn run` registering), it is a no-op. Both locks are checked (`Held.check`)
before each registry write: an advisory lock dies with its connection when PostgreSQL restarts; it is taken
back if nobody held it meanwhile (its epoch, a fencing token, did not move), else its holder stops rather than
write unguarded.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from xbn.config.errors import ConfigError
from xbn.tracking.runs import tracking_uri
from xbn.utils.locks import HELD_RUN_LOCKS, Held, LockTimeout, RunBusy, advisory_key, advisory_lock, file_lock
from xbn.utils.secrets import mask_secrets

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0


class RegistryLockTimeout(LockTimeout):
    """Another promotion held the registry lock for longer than the timeout."""


LOCK_URI_ENV = "XBN_LOCK_URI"


def lock_key(name: str) -> int:
    """A stable signed 64-bit advisory-lock key for a registered model name."""
    return advisory_key(_label(name))


def _label(name: str) -> str:
    return f"xbn-registry:{name}"


@contextlib.contextmanager
def registry_lock(uri: str, name: str, timeout: float = DEFAULT_TIMEOUT_S,
                  lock_uri: str | None = None) -> Iterator[Held]:
    """Hold the registry lock of model `name` in the store at tracking `uri` inside the block."""
    with contextlib.ExitStack() as held:
        try:
            hold = held.enter_context(_lock(uri, _label(name), name, timeout, lock_uri))
        except LockTimeout as exc:
            raise RegistryLockTimeout(f"registry: {exc}") from None
        yield hold


@contextlib.contextmanager
def run_lock(uri: str, name: str, what: str, wait_s: float = 0.0, lock_uri: str | None = None) -> Iterator[Held]:
    """Hold the run lock of model `name` inside the block (`what`: the command, for the message a second run
    gets); `wait_s`: how long a second run waits before it refuses to start (`RunBusy`)."""
    label = f"xbn-run:{name}"
    if label in HELD_RUN_LOCKS:  # this process already runs it (`xbn run` -> register): a no-op
        yield HELD_RUN_LOCKS[label]
        return
    with contextlib.ExitStack() as held:
        try:
            hold = held.enter_context(_lock(uri, label, name, wait_s, lock_uri, suffix=".run.lock"))
        except LockTimeout as exc:
            raise RunBusy(f"{what}: another run on {name} is in progress ({exc}); this one did not start: "
                          "run it again when that one has ended") from None
        HELD_RUN_LOCKS[label] = hold
        try:
            yield hold
        finally:
            del HELD_RUN_LOCKS[label]


def held_run_locks() -> tuple[Held, ...]:
    """The run locks this process holds (the registry checks them before each write)."""
    return tuple(HELD_RUN_LOCKS.values())


def pipeline_lock(params, what: str):
    """`run_lock` for a run of `params` (its store, model, `tracking.run_wait_s` and `tracking.lock_uri`)."""
    t = params.tracking
    return run_lock(tracking_uri(params), params.registry.model_name, what, t.run_wait_s, t.lock_uri)


def _lock(uri: str, label: str, name: str, timeout: float | None, lock_uri: str | None,
          suffix: str = ".registry.lock"):
    scheme = urlparse(uri).scheme.split("+")[0]
    shared = lock_uri_of(lock_uri)
    if shared:
        return advisory_lock(shared, label, timeout)
    if scheme in ("postgresql", "postgres"):
        return advisory_lock(uri, label, timeout)
    if scheme in ("http", "https"):
        raise ConfigError(f"tracking.lock_uri: the tracking server {mask_secrets(uri)} offers no lock, so {label} "
                          f"needs a PostgreSQL every registry writer shares: set ${LOCK_URI_ENV} (or "
                          "tracking.lock_uri) to its postgresql:// URL (infra/README.md)")
    return file_lock(_lock_file(uri, scheme, name, suffix), timeout)


def lock_uri_of(lock_uri: str | None) -> str | None:
    """Where the locks live when a URI names it: `$XBN_LOCK_URI`, else `tracking.lock_uri` (the environment
    wins, as `$MLFLOW_TRACKING_URI` does over `tracking.uri`)."""
    return os.environ.get(LOCK_URI_ENV) or lock_uri or None


def _lock_file(uri: str, scheme: str, name: str, suffix: str = ".registry.lock") -> Path:
    if scheme == "sqlite":
        db = uri.split(":///", 1)[1] if ":///" in uri else ""
        if db and db != ":memory:":
            return Path(db).with_name(Path(db).name + suffix)
    elif scheme in ("", "file"):  # a ./mlruns file store
        return Path(urlparse(uri).path if scheme else uri) / suffix
    digest = hashlib.sha256(f"{uri}\n{name}".encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"xbn-{digest}{suffix}"
