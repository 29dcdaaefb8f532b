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


class RunBusy(LockTimeout):
    """Another pipeline run on the same registered model holds the run lock (`xbn.tracking.locks.run_lock`)."""


class LockLost(RuntimeError):
    """A lock this process held is gone (its PostgreSQL connection died: a server restart, a failover); the
    holder must stop before it writes anything the lock guarded."""


class Held:
    """A held lock; `check()` raises `LockLost` when it no longer is. A file lock (flock) lives as long as the
    process, so its check passes; an advisory lock lives as long as its connection, so the check asks the
    server whether this session still holds it."""

    def __init__(self, label: str, conn=None, key: int | None = None) -> None:
        self.label, self._conn, self._key = label, conn, key

    def check(self) -> None:
        if self._conn is None:
            return
        import sqlalchemy as sa

        try:
            held = self._conn.execute(sa.text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = pg_backend_pid() "
                "AND ((classid::bigint << 32) | objid::bigint) = :k"), {"k": self._key}).scalar()
        except sa.exc.SQLAlchemyError as exc:
            raise LockLost(f"the lock {self.label!r} was lost with its database connection "
                           f"({type(exc).__name__}): stopping before any further write") from None
        if not held:
            raise LockLost(f"the lock {self.label!r} is no longer held by this process: stopping before any "
                           "further write")


def advisory_key(label: str) -> int:
    """A stable signed 64-bit advisory-lock key for `label`."""
    return int.from_bytes(hashlib.sha256(label.encode()).digest()[:8], "big", signed=True)


@contextlib.contextmanager
def advisory_lock(url: str, label: str, timeout: float | None = None) -> Iterator[Held]:
    """Hold the session advisory lock of `label` on the PostgreSQL database at `url` inside the block, on a
    connection of its own; `timeout` seconds at most to get it (None: wait)."""
    import sqlalchemy as sa

    key = advisory_key(label)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            if timeout is not None and timeout <= 0:  # no wait (lock_timeout 0 would mean wait forever)
                if not conn.execute(sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar():
                    raise LockTimeout(f"the advisory lock of {label!r} ({key}) is held by another session")
            elif timeout is not None:  # lock_timeout bounds the wait
                conn.execute(sa.text("SELECT set_config('lock_timeout', :t, false)"),
                             {"t": f"{max(1, int(timeout * 1000))}ms"})
            try:
                if timeout is None or timeout > 0:
                    conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": key})
            except sa.exc.OperationalError as exc:
                if "lock timeout" in str(exc):
                    raise LockTimeout(f"the advisory lock of {label!r} ({key}) was held for more than "
                                      f"{timeout:g} s") from None
                raise
            try:
                yield Held(label, conn, key)
            finally:  # closing the connection releases it too, should the unlock fail
                with contextlib.suppress(sa.exc.SQLAlchemyError):  # a connection that died released it
                    conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": key})
    finally:
        engine.dispose()


@contextlib.contextmanager
def file_lock(path: str | Path, timeout: float | None = None) -> Iterator[Held]:
    """Hold an flock on `path` (created with its folder) inside the block; `timeout` seconds at most."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=-1 if timeout is None else timeout)
    except TimeoutError:  # filelock.Timeout
        raise LockTimeout(f"the lock {path} was held for more than {timeout:g} s") from None
    try:
        yield Held(str(path))
    finally:
        lock.release()
