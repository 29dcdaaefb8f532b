"""Atomic file output: every artifact a later stage reads is written to a temp file and renamed into place,
so a crash never leaves a truncated file behind.

The temp file sits beside the target as `.<name>.<host>.<pid>.<token>.tmp` and gets the mode the umask gives
(0644 under umask 022), like any file the process creates. A process killed while it writes (SIGKILL, a lost
machine) runs no cleanup and leaves its temp file; the next write of the same target removes it, once the
process named in it is gone (a temp file of another host is left alone: its pid means nothing here).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from xbn.utils.locks import fence

_HOST = socket.gethostname()
_LIVE: set[Path] = set()  # temp files this process is writing now (any thread)
_LIVE_LOCK = threading.Lock()
_LEGACY_TEMP_AGE_S = 3600  # `.<name>.XXXXXXXX.tmp` of older versions: no pid, so removed only when this old


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path in the target's directory; on success it replaces `path` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    while True:
        tmp_path = path.with_name(f".{path.name}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:  # 0o666 & ~umask, as open() gives; mkstemp would make it 0600 whatever the umask
            os.close(os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
    with _LIVE_LOCK:
        _LIVE.add(tmp_path.absolute())
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)
        with _LIVE_LOCK:
            _LIVE.discard(tmp_path.absolute())


@contextlib.contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """Yield a new empty folder beside `path`; on success it takes `path`'s place whole: the old folder is moved
    aside, the new one renamed in, the old one removed. Two writers each fill a folder of their own, so the
    result is one writer's folder, never a mix of both (the last to finish wins), and a reader sees the old
    folder, then briefly none, then the new one. On failure the new folder is removed; folders left by writers
    killed on this host are removed first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = re.compile(rf"\.{re.escape(path.name)}\.(?P<host>.+)\.(?P<pid>\d+)\.[0-9a-f]{{8}}\.(building|old)")
    for entry in sorted(os.scandir(path.parent), key=lambda e: e.name):
        if (found := mine.fullmatch(entry.name)) and found["host"] == _HOST and not _alive(int(found["pid"])):
            if entry.name.endswith(".old") and not path.exists():  # killed between its two renames: put it back
                os.rename(entry.path, path)
            else:
                shutil.rmtree(entry.path, ignore_errors=True)
    tag = f"{_HOST}.{os.getpid()}.{secrets.token_hex(4)}"
    building = path.with_name(f".{path.name}.{tag}.building")
    building.mkdir()
    try:
        yield building
        fence()  # a run that lost its lock does not replace another run's folder
        while True:
            old = path.with_name(f".{path.name}.{tag}.old")
            with contextlib.suppress(FileNotFoundError):
                path.rename(old)
            try:
                building.rename(path)
            except OSError:  # another writer renamed its folder in since ours moved the old one aside: again
                shutil.rmtree(old, ignore_errors=True)
                continue
            shutil.rmtree(old, ignore_errors=True)
            return
    finally:
        shutil.rmtree(building, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temps(path: str | Path) -> list[Path]:
    """Remove the temp files that writers of `path` killed mid-write left beside it; returns them."""
    path = Path(path)
    ours = re.compile(rf"\.{re.escape(path.name)}\.(?P<host>.+)\.(?P<pid>\d+)\.[0-9a-f]{{8}}\.tmp")
    legacy = re.compile(rf"\.{re.escape(path.name)}\.[a-z0-9_]{{8}}\.tmp")
    removed: list[Path] = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(f".{path.name}.") or not entry.name.endswith(".tmp"):
            continue
        temp = Path(entry.path)
        if match := ours.fullmatch(entry.name):
            if match["host"] != _HOST or _writing(int(match["pid"]), temp):
                continue
        elif legacy.fullmatch(entry.name):
            with contextlib.suppress(OSError):
                if time.time() - entry.stat().st_mtime < _LEGACY_TEMP_AGE_S:
                    continue
        else:
            continue
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
            removed.append(temp)
    return removed


def _writing(pid: int, temp: Path) -> bool:
    """Whether process `pid` of this host may still be writing `temp`."""
    if pid == os.getpid():
        with _LIVE_LOCK:
            return temp.absolute() in _LIVE
    return _alive(pid)


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    # numpy scalars and paths show up in metrics; everything else is a bug worth an error.
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def save_torch(path: str | Path, obj: Any) -> None:
    import torch

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
        fence()  # a run that lost its lock does not replace another run's checkpoint


def file_digest(path: str | Path, algorithm: str = "sha256") -> str:
    """Hex digest of a file's bytes, read in chunks (checkpoints can be large)."""
    digest = hashlib.new(algorithm)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_csv(path: Path, rows: list[dict], columns: list[str] | None = None) -> None:
    columns = columns or list(dict.fromkeys(k for row in rows for k in row))
    lines = [",".join(columns)]
    lines += [",".join("" if row.get(c) is None else f"{row[c]:.6g}" if isinstance(row.get(c), float)
                       else str(row[c]) for c in columns) for row in rows]
    write_text(path, "\n".join(lines) + "\n")
