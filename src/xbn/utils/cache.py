"""Where xbn keeps what it can always rebuild, keyed by content: the decoded training images (`data.cache`,
under `decoded/`) and the ONNX graphs exported for ONNX Runtime (`inference.engine`, under `onnx/`). One folder
per user, as pip's and torch's caches are, so projects on the same data or checkpoint share it: `$XBN_CACHE_DIR`,
else `$XDG_CACHE_HOME/xbn`, else `~/.cache/xbn`. Deleting it loses nothing but time."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "XBN_CACHE_DIR"


def cache_root() -> Path:
    if root := os.environ.get(CACHE_ENV, "").strip():
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "xbn"
