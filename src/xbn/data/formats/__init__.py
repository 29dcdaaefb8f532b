"""One reader per on-disk dataset format, each `read(root, **options) -> manifest DataFrame`, by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from xbn.data.errors import DatasetError
from xbn.data.formats import cars196, csvfile, cub, deepfashion2, folder, inshop, sop

Reader = Callable[..., pd.DataFrame]

READERS: dict[str, Reader] = {
    "cub": cub.read,
    "cars196": cars196.read,
    "sop": sop.read,
    "inshop": inshop.read,
    "deepfashion2": deepfashion2.read,
    "folder": folder.read,
    "csv": csvfile.read,
    # The generated default set is written in the generic CSV layout.
    "glyphs": csvfile.read,
}


def read_dataset(
    name: str, root: str | Path, labels_file: str | Path | None = None, **options: Any
) -> pd.DataFrame:
    """Read dataset `name` at `root` into a manifest; `options` go to the reader (e.g. folder's `seed`)."""
    if name not in READERS:
        raise DatasetError(f"unknown dataset format {name!r}; known: {sorted(READERS)}")
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"dataset root {root} is not a directory")
    reader = READERS[name]
    if labels_file is not None:
        if reader is not csvfile.read:
            raise DatasetError(f"labels_file is only read by csv-layout datasets, not {name!r}")
        options["labels_file"] = labels_file
    df = reader(root, **options)
    if df.empty:
        raise DatasetError(f"{name} dataset at {root}: no images listed")
    return df
