"""A lock around the registry's decide-and-move-alias step, so concurrent `register`/`promote`/`rollback`
runs against one tracking store act one after the other: each one reads the champion the previous one left.

The lock lives where the store is:
- a SQLite store: a file lock next to the database file (`<db>.registry.lock`);
- a database store (PostgreSQL): a session-level advisory lock (`pg_advisory_lock`) on the same database,
  keyed by the registered model's name, held on its own connection and released when that connection ends
  (so a killed holder never leaves it stuck);
- a tracking server (http): the server offers no lock, so only processes of this machine are serialised, with
  a file lock in the temp directory keyed by the URI.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from filelock import FileLock, Timeout

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0


class RegistryLockTimeout(TimeoutError):
    """Another promotion held the registry lock for longer than the timeout."""


def lock_key(name: str) -> int:
    """A stable signed 64-bit advisory-lock key for a registered model name."""
    return int.from_bytes(hashlib.sha256(f"xbn-registry:{name}".encode()).digest()[:8], "big", signed=True)


@contextlib.contextmanager
def registry_lock(uri: str, name: str, timeout: float = DEFAULT_TIMEOUT_S) -> Iterator[None]:
    """Hold the registry lock of model `name` in the store at tracking `uri` inside the block."""
    scheme = urlparse(uri).scheme.split("+")[0]
    if scheme in ("postgresql", "postgres"):
        with _advisory_lock(uri, lock_key(name), timeout):
            yield
        return
    with _file_lock(_lock_file(uri, scheme, name), timeout):
        yield


def _lock_file(uri: str, scheme: str, name: str) -> Path:
    if scheme == "sqlite":
        db = uri.split(":///", 1)[1] if ":///" in uri else ""
        if db and db != ":memory:":
            return Path(db).with_name(Path(db).name + ".registry.lock")
    elif scheme in ("", "file"):  # a ./mlruns file store
        return Path(urlparse(uri).path if scheme else uri) / ".registry.lock"
    digest = hashlib.sha256(f"{uri}\n{name}".encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"xbn-registry-{digest}.lock"


@contextlib.contextmanager
def _file_lock(path: Path, timeout: float) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=timeout)
    except Timeout:
        raise RegistryLockTimeout(f"the registry lock {path} was held for more than {timeout:g} s") from None
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def _advisory_lock(uri: str, key: int, timeout: float) -> Iterator[None]:
    import sqlalchemy as sa

    engine = sa.create_engine(uri, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            # lock_timeout bounds the wait; the lock is the session's, so it is released with the connection.
            conn.execute(sa.text("SELECT set_config('lock_timeout', :t, false)"),
                         {"t": f"{int(timeout * 1000)}ms"})
            try:
                conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": key})
            except sa.exc.OperationalError as exc:
                if "lock timeout" in str(exc):
                    raise RegistryLockTimeout(
                        f"the registry advisory lock {key} was held for more than {timeout:g} s") from None
                raise
            conn.commit()
            try:
                yield
            finally:
                conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                conn.commit()
    finally:
        engine.dispose()
