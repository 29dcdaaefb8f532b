"""Where a study lives, and the study-wide lock that makes the trial budget exact across workers.

- `sqlite:///FILE` (the default for one process): an RDB storage with heartbeats. Never for parallel workers
  (Optuna's FAQ): SQLite locks the whole file and workers fail with "database is locked".
- `journal:FILE` (the default for `--workers N`): Optuna's JournalStorage, safe for processes on one machine.
  It has no heartbeats: the coordinator fails the trials of a worker process that died (see `study.py`).
  Its file lock is an flock (`_JournalLock`), not Optuna's default symlink lock: a worker killed while it
  reads or appends the journal would leave the symlink behind, and with a relative path Optuna's stale-lock
  check stats a dangling link and never breaks it, so every other worker waited forever.
- `postgresql://...` (or another SQLAlchemy URL): workers on several machines join one study; a worker that
  stops sending heartbeats for `grace_period` has its running trial marked failed by the next worker that
  looks.

The lock: a worker claims a trial by counting the study's trials and enqueueing one more, both under this
lock, so N workers never start more than `tune.trials` trials between them. It is a PostgreSQL advisory
lock (released by the server if the worker dies) or an flock on a file next to a file storage
(`xbn.utils.locks`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import optuna
from filelock import FileLock
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend
from optuna.storages.journal._file import BaseJournalFileLock  # the type of lock_obj, not re-exported

from xbn.config import ConfigError, TuneConfig
from xbn.utils.locks import advisory_lock, file_lock
from xbn.utils.secrets import mask_secrets

log = logging.getLogger(__name__)

JOURNAL = "journal:"


@dataclass(frozen=True)
class StorageSpec:
    url: str  # journal:PATH or an SQLAlchemy URL

    @property
    def kind(self) -> str:
        if self.url.startswith(JOURNAL):
            return "journal"
        return self._url().get_backend_name()  # sqlite, postgresql, mysql, ...

    @property
    def path(self) -> Path | None:
        """The file of a journal or SQLite storage."""
        if self.kind == "journal":
            return Path(self.url.removeprefix(JOURNAL))
        return Path(self._url().database) if self.kind == "sqlite" else None

    @property
    def heartbeats(self) -> bool:
        return self.kind != "journal"

    def redacted(self) -> str:
        return self.url if self.kind == "journal" else self._url().render_as_string(hide_password=True)

    def _url(self):
        from sqlalchemy.engine import make_url

        return make_url(self.url)


STORAGE_ENV = "OPTUNA_STORAGE"  # wins over tune.storage, as $MLFLOW_TRACKING_URI over tracking.uri: a password
# in a URL stays in the environment (infra/compose.yaml sets it), never in params.yaml or a record


def resolve_storage(cfg: TuneConfig, workers: int) -> StorageSpec:
    storage = os.environ.get(STORAGE_ENV) or cfg.storage
    if storage is None:
        return StorageSpec(f"{JOURNAL}{Path(cfg.dir) / 'optuna.journal'}" if workers > 1
                           else f"sqlite:///{Path(cfg.dir) / 'optuna.db'}")
    spec = StorageSpec(storage)
    where = f"${STORAGE_ENV}" if os.environ.get(STORAGE_ENV) else "tune.storage"
    try:
        kind = spec.kind
    except Exception:  # noqa: BLE001 - sqlalchemy's ArgumentError and friends: any unparsable URL
        raise ConfigError(f"{where}: '{mask_secrets(storage)}' is neither journal:FILE nor a database URL "
                          "(sqlite:///FILE, postgresql://user@host/db)") from None
    if kind == "sqlite" and workers > 1:
        raise ConfigError(f"{where}: SQLite is not safe for parallel workers; use journal:FILE (one "
                          "machine) or postgresql://... (several), or leave tune.storage null")
    return _with_installed_driver(spec)


def _with_installed_driver(spec: StorageSpec) -> StorageSpec:
    """SQLAlchemy 2.1 reads a bare postgresql:// as psycopg 3; this project installs psycopg2."""
    url = spec._url() if spec.kind == "postgresql" else None
    if url is None or "+" in url.drivername or importlib.util.find_spec("psycopg") is not None:
        return spec
    return StorageSpec(url.set(drivername="postgresql+psycopg2").render_as_string(hide_password=False))


def open_storage(spec: StorageSpec, cfg: TuneConfig) -> BaseStorage:
    path = spec.path
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    if spec.kind == "journal":
        assert path is not None  # a journal is a file
        return journal_storage(path)
    with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna since 2.9, and what we need
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return RDBStorage(spec.url, heartbeat_interval=cfg.heartbeat_interval, grace_period=cfg.grace_period,
                          engine_kwargs={"pool_pre_ping": True} if spec.kind != "sqlite" else None)


def journal_storage(path: str | Path) -> JournalStorage:
    """Optuna's journal on `path`, locked by an flock that a killed process cannot leave behind."""
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(path), lock_obj=_JournalLock(path.with_name(f"{path.name}.flock"))))


def study_lock(spec: StorageSpec, study_name: str) -> contextlib.AbstractContextManager:
    if spec.path is not None:
        return _Reusable(file_lock, spec.path.with_name(f"{spec.path.name}.{_digest(study_name)}.lock"))
    if spec.kind == "postgresql":
        return _Reusable(advisory_lock, spec.url, f"xbn-tune/{study_name}")
    log.warning("tune.storage %s: no cross-process lock for %s; with several workers the study may run up "
                "to workers - 1 trials more than tune.trials", spec.redacted(), spec.kind)
    return _LOCAL


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class _Reusable:
    """A lock context manager to enter again and again (each worker holds one for its whole loop)."""

    def __init__(self, make, *args):
        self._make, self._args = make, args

    def __enter__(self):
        self._held = self._make(*self._args)
        self._held.__enter__()

    def __exit__(self, *exc):
        return self._held.__exit__(*exc)


class _JournalLock(BaseJournalFileLock):
    """Optuna's journal lock (its `lock_obj`: acquire/release, the interface of its lock classes) as an flock:
    the kernel drops it when its holder dies, so a killed worker never blocks the others. Optuna's own locks
    (symlink, open) are lock *files* that outlive a SIGKILL. filelock gives each thread its own descriptor, so
    threads sharing this object exclude each other too."""

    def __init__(self, path: Path):
        self._lock = FileLock(path)

    def acquire(self) -> bool:
        self._lock.acquire()
        return True

    def release(self) -> None:
        self._lock.release()


_LOCAL = threading.Lock()
