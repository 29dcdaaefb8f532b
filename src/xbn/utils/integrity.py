"""Integrity of model files: a checkpoint is loaded only if its bytes hash to the sha256 recorded for it, so a
file altered or swapped after it was written (a flipped byte on disk, a hand-edited artifact store) is refused
instead of being run.

Two records are trusted: the version tag `model_sha256` of a registered model (`xbn.tracking.registry`), and
for a local checkpoint its sidecar `<file>.sha256` written right after it (`write_sidecar`), in `sha256sum`
format so `sha256sum -c models/model.pt.sha256` checks it too. A checkpoint without a sidecar (written by an
older xbn) loads with a warning.
"""

from __future__ import annotations

import logging
from pathlib import Path

from xbn.utils.errors import IntegrityError
from xbn.utils.io import atomic_path, file_digest

log = logging.getLogger(__name__)

SIDECAR_SUFFIX = ".sha256"


def sidecar_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + SIDECAR_SUFFIX)


def verify_file(path: str | Path, expected_sha256: str, what: str = "model file",
                recorded: str = "was recorded when it was registered") -> str:
    """Return the file's sha256 if it equals `expected_sha256`, else raise `IntegrityError` naming the file,
    both hashes and where the expected one comes from (`recorded`)."""
    actual = file_digest(path)
    if actual != expected_sha256.strip().lower():
        raise IntegrityError(
            f"refusing to load {what} {path}: its sha256 is {actual} but {expected_sha256} {recorded}; the file "
            f"was altered or replaced after it was written")
    return actual


def verify_listed(directory: str | Path, digests: dict[str, str], listed_in: str) -> None:
    """Check every file `digests` names under `directory` (a catalogue index's `index.json`: `listed_in`);
    `IntegrityError` naming the first that is missing or differs."""
    directory = Path(directory)
    for name, digest in digests.items():
        path = directory / name
        if not path.is_file():
            raise IntegrityError(f"{path} is missing: {listed_in} names it; rebuild the index")
        verify_file(path, digest, what="the index file", recorded=f"is what {listed_in} records")


def write_sidecar(path: str | Path) -> Path:
    """Write `<path>.sha256` for the file at `path` as it is on disk now (atomically); returns the sidecar."""
    path = Path(path)
    sidecar = sidecar_path(path)
    with atomic_path(sidecar) as tmp:
        tmp.write_text(f"{file_digest(path)}  {path.name}\n")
    return sidecar


def remove_sidecar(path: str | Path) -> None:
    """Drop `<path>.sha256` before `path` is rewritten: a save killed in between leaves a file without a sidecar
    (loaded with a warning), never a new file beside an old hash (refused as if it had been altered)."""
    sidecar_path(path).unlink(missing_ok=True)


def verify_sidecar(path: str | Path) -> str:
    """Check the file at `path` against its sidecar; return its sha256. A mismatch (or an unreadable sidecar)
    raises `IntegrityError` naming the file; a missing sidecar is accepted with a warning."""
    sidecar = sidecar_path(path)
    try:
        text = sidecar.read_text().split()
    except FileNotFoundError:
        log.warning("%s has no %s sidecar (written by an older xbn?): loading it unverified", path, sidecar.name)
        return file_digest(path)
    if not text or len(text[0]) != 64:
        raise IntegrityError(f"refusing to load {path}: its sidecar {sidecar} holds no sha256; retrain it "
                             f"(`xbn train`) or delete the sidecar to load it unverified")
    return verify_file(path, text[0], what="checkpoint", recorded=f"is recorded in {sidecar}")
