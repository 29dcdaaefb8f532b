"""Integrity of model files: a checkpoint is loaded only if its bytes hash to the sha256 recorded when it was
logged, so a file swapped or altered in the artifact store is refused instead of being run."""

from __future__ import annotations

from pathlib import Path

from xbn.tracking.fingerprints import file_digest


class IntegrityError(RuntimeError):
    """A model file whose sha256 differs from the one recorded for it; the message names the file and both."""


def verify_file(path: str | Path, expected_sha256: str, what: str = "model file") -> str:
    """Return the file's sha256 if it equals `expected_sha256`, else raise `IntegrityError`."""
    actual = file_digest(path)
    if actual != expected_sha256.strip().lower():
        raise IntegrityError(
            f"refusing to load {what} {path}: its sha256 is {actual} but {expected_sha256} was recorded when "
            f"it was registered; the file was altered or replaced after registration")
    return actual
