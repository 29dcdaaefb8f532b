"""A generic label file `path,label,split` (also what the glyph generator writes), read as a manifest.

The file is `labels_file` when given (a path as configured, not joined to the root), else `<root>/labels.csv`.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from xbn.data.manifest import read_manifest


def read(root: Path, *, labels_file: str | Path | None = None) -> pd.DataFrame:
    return read_manifest(Path(labels_file) if labels_file is not None else root / "labels.csv")
