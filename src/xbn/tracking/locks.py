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

from xbn.utils.locks import LockTimeout, advisory_key, advisory_lock, file_lock

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0


class RegistryLockTimeout(LockTimeout):
    """Another promotion held the registry lock for longer than the timeout."""


def lock_key(name: str) -> int:
    """A stable signed 64-bit advisory-lock key for a registered model name."""
    return advisory_key(_label(name))


def _label(name: str) -> str:
    return f"xbn-registry:{name}"


@contextlib.contextmanager
def registry_lock(uri: str, name: str, timeout: float = DEFAULT_TIMEOUT_S) -> Iterator[None]:
    """Hold the registry lock of model `name` in the store at tracking `uri` inside the block."""
    scheme = urlparse(uri).scheme.split("+")[0]
    lock = (advisory_lock(uri, _label(name), timeout) if scheme in ("postgresql", "postgres")
            else file_lock(_lock_file(uri, scheme, name), timeout))
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(lock)
        except LockTimeout as exc:
            raise RegistryLockTimeout(f"registry: {exc}") from None
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
