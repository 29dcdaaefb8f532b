"""Locks between processes that a killed holder cannot leave behind: a PostgreSQL session advisory lock (the
server drops it with the connection) and an flock on a file (the kernel drops it with the process), through
filelock. The registry's promotions and the tuning study's trial claims both use them."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock


class LockTimeout(TimeoutError):
    """The lock was held by someone else for longer than the timeout."""


def advisory_key(label: str) -> int:
    """A stable signed 64-bit advisory-lock key for `label`."""
    return int.from_bytes(hashlib.sha256(label.encode()).digest()[:8], "big", signed=True)


@contextlib.contextmanager
def advisory_lock(url: str, label: str, timeout: float | None = None) -> Iterator[None]:
    """Hold the session advisory lock of `label` on the PostgreSQL database at `url` inside the block, on a
    connection of its own; `timeout` seconds at most to get it (None: wait)."""
    import sqlalchemy as sa

    key = advisory_key(label)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            if timeout is not None:  # lock_timeout bounds the wait
                conn.execute(sa.text("SELECT set_config('lock_timeout', :t, false)"),
                             {"t": f"{int(timeout * 1000)}ms"})
            try:
                conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": key})
            except sa.exc.OperationalError as exc:
                if "lock timeout" in str(exc):
                    raise LockTimeout(f"the advisory lock of {label!r} ({key}) was held for more than "
                                      f"{timeout:g} s") from None
                raise
            try:
                yield
            finally:  # closing the connection releases it too, should the unlock fail
                conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": key})
    finally:
        engine.dispose()


@contextlib.contextmanager
def file_lock(path: str | Path, timeout: float | None = None) -> Iterator[None]:
    """Hold an flock on `path` (created with its folder) inside the block; `timeout` seconds at most."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=-1 if timeout is None else timeout)
    except TimeoutError:  # filelock.Timeout
        raise LockTimeout(f"the lock {path} was held for more than {timeout:g} s") from None
    try:
        yield
    finally:
        lock.release()
