"""Locks between processes that a killed holder cannot leave behind: a PostgreSQL session advisory lock (the
server drops it with the connection) and an flock on a file (the kernel drops it with the process), through
filelock. The registry's promotions and the tuning study's trial claims both use them."""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock

log = logging.getLogger(__name__)


class LockTimeout(TimeoutError):
    """The lock was held by someone else for longer than the timeout."""


class RunBusy(LockTimeout):
    """Another pipeline run on the same registered model holds the run lock (`xbn.tracking.locks.run_lock`)."""


class LockLost(RuntimeError):
    """A lock this process held is gone (its PostgreSQL connection died: a server restart, a failover); the
    holder must stop before it writes anything the lock guarded."""


class Held:
    """A held lock; `check()` raises `LockLost` when it no longer is. A file lock (flock) lives as long as the
    process, so its check passes. An advisory lock lives as long as its connection: a PostgreSQL restart or a
    failover ends it. The check then takes it back, if the lock is free and nobody held it meanwhile: each
    acquisition bumps the label's epoch (a fencing token, in the table `xbn_lock_epochs`), so an epoch that
    moved means another holder ran in between, and the lock counts as lost."""

    def __init__(self, label: str, conn=None, key: int | None = None, engine=None,
                 epoch: int | None = None) -> None:
        self.label, self._conn, self._key, self._engine, self.epoch = label, conn, key, engine, epoch
        self.regained = 0  # how often the lock was taken back after its connection died

    def check(self) -> None:
        if self._conn is None:
            return
        import sqlalchemy as sa

        try:
            held = self._conn.execute(sa.text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = pg_backend_pid() "
                "AND ((classid::bigint << 32) | objid::bigint) = :k"), {"k": self._key}).scalar()
        except sa.exc.SQLAlchemyError as exc:
            self._regain(f"{type(exc).__name__}")
            return
        if not held:
            raise LockLost(f"the lock {self.label!r} is no longer held by this process: stopping before any "
                           "further write")

    def _regain(self, why: str) -> None:
        """Take the lock back on a new connection after its own died (bounded: `REGAIN_WAIT_S` for the server to
        come back), only if its epoch is still this holder's."""
        import time

        import sqlalchemy as sa

        lost = LockLost(f"the lock {self.label!r} was lost with its database connection ({why}): stopping "
                        "before any further write")
        if self.epoch is None or self._engine is None:
            raise lost from None  # no fencing token: whether another holder ran meanwhile cannot be known
        deadline, pause = time.monotonic() + REGAIN_WAIT_S, 0.5
        while True:
            try:
                conn = self._engine.connect()
                break
            except sa.exc.SQLAlchemyError:
                if time.monotonic() > deadline:
                    raise lost from None
                time.sleep(pause)
                pause = min(pause * 2, 5.0)
        try:
            if not conn.execute(sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": self._key}).scalar():
                raise LockLost(f"the lock {self.label!r} was lost with its database connection ({why}) and "
                               "another process holds it now: stopping before any further write")
            epoch = _epoch(conn, self.label)
            if epoch != self.epoch:
                conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": self._key})
                raise LockLost(f"the lock {self.label!r} was lost with its database connection ({why}) and "
                               f"another process held it meanwhile (epoch {self.epoch} -> {epoch}): stopping "
                               "before any further write")
        except BaseException:
            conn.close()
            raise
        with contextlib.suppress(sa.exc.SQLAlchemyError):
            self._conn.close()
        self._conn, self.regained = conn, self.regained + 1
        log.warning("the lock %r died with its database connection (%s) and was taken back: nobody held it "
                    "meanwhile (epoch %s)", self.label, why, epoch)


# The run locks this process holds, by label (`xbn.tracking.locks.run_lock` fills it): what `fence` checks.
HELD_RUN_LOCKS: dict[str, Held] = {}


def fence() -> None:
    """Raise `LockLost` if a run lock this process holds was lost: called right before a write to the shared
    local outputs (models/, an index folder) becomes visible, so that a run whose lock another run took after a
    database restart stops before it overwrites that run's files. Holding no run lock: nothing to check."""
    for held in tuple(HELD_RUN_LOCKS.values()):
        held.check()


REGAIN_WAIT_S = 60.0  # how long a lost advisory lock waits for its database to come back before it gives up
_EPOCHS = "xbn_lock_epochs"


def _epoch(conn, label: str, bump: bool = False) -> int | None:
    """The label's acquisition count in `xbn_lock_epochs` (`bump`: count this acquisition first); None when the
    table cannot be made or read (no CREATE right): the lock then works without being regained."""
    import sqlalchemy as sa

    try:
        if bump:
            conn.execute(sa.text(f"CREATE TABLE IF NOT EXISTS {_EPOCHS} (label text PRIMARY KEY, "
                                 "epoch bigint NOT NULL)"))
            return conn.execute(sa.text(
                f"INSERT INTO {_EPOCHS} VALUES (:l, 1) ON CONFLICT (label) DO UPDATE SET epoch = "
                f"{_EPOCHS}.epoch + 1 RETURNING epoch"), {"l": label}).scalar()
        return conn.execute(sa.text(f"SELECT epoch FROM {_EPOCHS} WHERE label = :l"), {"l": label}).scalar()
    except sa.exc.SQLAlchemyError as exc:  # e.g. a concurrent first CREATE, or an account without CREATE
        log.warning("lock epochs unavailable (%s): a lock lost with its connection will not be taken back",
                    type(exc).__name__)
        return None


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
            held = Held(label, conn, key, engine, _epoch(conn, label, bump=True))
            try:
                yield held
            finally:  # closing the connection releases it too, should the unlock fail
                with contextlib.suppress(sa.exc.SQLAlchemyError):  # a connection that died released it
                    held._conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                if held._conn is not conn:  # taken back on a connection of its own after a restart
                    with contextlib.suppress(sa.exc.SQLAlchemyError):
                        held._conn.close()
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
