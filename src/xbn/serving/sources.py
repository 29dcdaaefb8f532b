"""Where a catalogue's images come from: the manifest's test gallery, a folder, or a manifest-format CSV.

Every source becomes the same thing, a frame of `path` (relative to a root) and `label` (None when unknown)
plus that root, so embedding, indexing and the batch job read one shape.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from xbn.data import read_manifest
from xbn.data.errors import DatasetError

# The extensions a folder source picks up (case-insensitive); anything else in the folder is ignored.
IMAGE_SUFFIXES = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}
)


def gallery_rows(manifest: pd.DataFrame) -> pd.DataFrame:
    """The rows the evaluation searches against: `gallery` where the dataset has a query/gallery protocol
    (In-Shop), else the whole `test` split (leave-one-out datasets)."""
    split = "gallery" if "gallery" in set(manifest["split"]) else "test"
    rows = manifest[manifest["split"] == split]
    if rows.empty:
        raise DatasetError(f"the manifest has no '{split}' rows to index")
    return rows


def read_source(
    source: str | Path, *, manifest: str | Path | None = None, root: str | Path | None = None
) -> tuple[pd.DataFrame, Path]:
    """(frame with `path`, `label`, root) for a catalogue source.

    - `"test"`: the gallery of the manifest at `manifest`, paths relative to `root` (`data.root`);
    - a folder: every image file under it, recursively, sorted, paths relative to the folder, no labels;
    - a CSV in the manifest format (`path,label,split`; every split is taken): paths relative to `root`
      when given, else to the CSV's folder.
    """
    if str(source) == "test":
        if manifest is None or root is None:
            raise ValueError("source 'test' needs the manifest and the dataset root")
        return _columns(gallery_rows(read_manifest(manifest))), Path(root)
    path = Path(source)
    if path.is_dir():
        files = sorted(
            p.relative_to(path).as_posix()
            for p in path.rglob("*")
            if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
        )
        if not files:
            raise DatasetError(f"{path}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) under it")
        return pd.DataFrame({"path": files, "label": pd.Series([None] * len(files), dtype=object)}), path
    if path.is_file():
        return _columns(read_manifest(path)), Path(root) if root is not None else path.parent
    raise DatasetError(f"catalogue source {source!r} is neither 'test', a folder nor a CSV file")


def source_root(source: str | Path, root: str | Path | None = None) -> Path:
    """The folder the catalogue's relative paths start from, as `read_source` resolves it (without reading
    the catalogue): `root` for "test" and for a CSV when given, else the folder or the CSV's folder."""
    path = Path(source)
    if str(source) == "test" or (path.is_file() and root is not None):
        if root is None:
            raise ValueError("source 'test' needs the dataset root")
        return Path(root)
    return path if path.is_dir() else path.parent


def _columns(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[["path", "label"]].reset_index(drop=True).astype({"path": str, "label": object})
