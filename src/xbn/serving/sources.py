"""Where a catalogue's images come from: the manifest's test gallery, a folder, a manifest-format CSV, or a
parquet file of paths; the last three local or at an fsspec URL (`s3://bucket/prefix`, `gs://...`).

Every source becomes the same thing, a frame of `path` (relative to a root) and `label` (None when unknown)
plus that root, so embedding, indexing and the batch job read one shape. A remote root stays a URL string;
`local_images` brings a batch of its rows to a local folder for the image loader.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from xbn.config import ConfigError
from xbn.data import read_manifest, safe_relative_path
from xbn.data.errors import DatasetError

log = logging.getLogger(__name__)

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


def inside(root: str | Path, relative: str) -> Path | None:
    """`root / relative` when it stays under `root` lexically, else None. Lexically, not resolved: symbolic
    links inside the catalogue are its owner's doing (a DVC cache links every file out), a stored path is not."""
    root = os.path.normpath(os.path.abspath(root))
    path = os.path.normpath(os.path.join(root, relative))
    return Path(path) if not os.path.isabs(relative) and path.startswith(root + os.sep) else None


def is_remote(location: str | Path) -> bool:
    """Whether `location` is an fsspec URL of another filesystem than the local one (file:// is local)."""
    text = str(location)
    return "://" in text and not text.startswith("file://")


def read_source(
    source: str | Path, *, manifest: str | Path | None = None, root: str | Path | None = None
) -> tuple[pd.DataFrame, Path | str]:
    """(frame with `path`, `label`, root) for a catalogue source.

    - `"test"`: the gallery of the manifest at `manifest`, paths relative to `root` (`data.root`);
    - a folder: every image file under it, recursively, sorted, paths relative to the folder, no labels;
    - a CSV in the manifest format (`path,label,split`; every split is taken), or a parquet file with a
      `path` column (and optionally `label`): paths relative to `root` when given, else to the file's folder.

    The last three may be fsspec URLs; the root is then a URL string too.
    """
    if str(source) == "test":
        if manifest is None or root is None:
            raise ValueError("source 'test' needs the manifest and the dataset root")
        return _columns(gallery_rows(read_manifest(manifest))), Path(root)
    if is_remote(source) or (root is not None and is_remote(root)):
        return _remote_source(str(source), root)
    path = Path(str(source).removeprefix("file://"))
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
        rows = read_path_table(path) if path.suffix.lower() == ".parquet" else read_manifest(path)
        return _columns(rows), Path(root) if root is not None else path.parent
    raise DatasetError(f"catalogue source {source!r} is neither 'test', a folder, a CSV nor a parquet file")


def read_path_table(path: str | Path, storage_options: dict | None = None) -> pd.DataFrame:
    """A parquet file's `path` (checked as a manifest's paths are) and `label` (None when it has none)."""
    try:
        table = pd.read_parquet(path, storage_options=storage_options)
    except (OSError, ValueError) as exc:
        raise DatasetError(f"cannot read parquet file {path}: {exc}") from None
    if "path" not in table.columns:
        raise DatasetError(f"{path}: no 'path' column (columns: {list(table.columns)})")
    # Strings only: str() turned an int into "1", bytes into "b'...'" and a null into "nan", all silently.
    bad = next(((i, p) for i, p in enumerate(table["path"]) if not isinstance(p, str)), None)
    if bad is not None:
        raise DatasetError(f"{path}: row {bad[0] + 1}: 'path' must be a string, got {type(bad[1]).__name__} "
                           f"{bad[1]!r}")
    paths = [safe_relative_path(p, path, i + 1) for i, p in enumerate(table["path"])]
    labels = table["label"] if "label" in table.columns else [None] * len(paths)
    return pd.DataFrame({"path": paths,
                         "label": pd.Series([None if pd.isna(v) else str(v) for v in labels], dtype=object)})


def _remote_source(source: str, root: str | Path | None) -> tuple[pd.DataFrame, str]:
    import fsspec

    try:
        fs, where = fsspec.core.url_to_fs(source)
    except ImportError as exc:  # fsspec's "Install s3fs to access S3": a missing extra, not a crash
        raise ConfigError(f"catalogue source {source}: {exc}") from None
    if fs.isdir(where):
        prefix = where.rstrip("/") + "/"
        files = sorted(p[len(prefix):] for p in fs.find(where) if Path(p).suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise DatasetError(f"{source}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) under it")
        return pd.DataFrame({"path": files, "label": pd.Series([None] * len(files), dtype=object)}), \
            source.rstrip("/")
    if not fs.isfile(where):
        raise DatasetError(f"catalogue source {source!r}: no such folder or file")
    if where.lower().endswith(".parquet"):
        with fs.open(where, "rb") as fh:
            frame = read_path_table(fh)
    else:  # the manifest reader takes a local file: the CSV is copied first, its errors still name the URL
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / Path(where).name
            fs.get(where, str(local))
            try:
                frame = read_manifest(local)
            except DatasetError as exc:
                raise DatasetError(str(exc).replace(str(local), source)) from None
    return _columns(frame), str(root) if root is not None else source.rsplit("/", 1)[0]


@contextlib.contextmanager
def local_images(rows: pd.DataFrame, root: str | Path) -> Iterator[Path]:
    """A local folder holding `rows`' images: `root` itself when local; for a remote root, a temp folder the
    rows' files are fetched into (removed afterwards). A file that cannot be fetched is left out, so the
    loader reports it unreadable like any other."""
    if not is_remote(root):
        yield Path(str(root).removeprefix("file://"))
        return
    import fsspec

    fs, base = fsspec.core.url_to_fs(str(root))
    with tempfile.TemporaryDirectory(prefix="xbn-images-") as tmp:
        # A key is fetched, and written, only when it stays under the root (the rule `inside` keeps for a local
        # catalogue): a row "../x" or "/etc/x" would read outside the catalogue's prefix and write outside tmp.
        wanted = {f"{base.rstrip('/')}/{p}": local for p in rows["path"].astype(str)
                  if (local := inside(tmp, p)) is not None}
        if refused := len(rows) - len(wanted):
            log.warning("catalogue %s: %d row(s) name a path outside it (absolute or with '..'): left out",
                        root, refused)
        fetched = fs.cat(list(wanted), on_error="omit")  # concurrent on object stores (s3fs, gcsfs)
        for remote, data in fetched.items():
            if isinstance(data, bytes):
                local = wanted[remote]
                local.parent.mkdir(parents=True, exist_ok=True)
                local.write_bytes(data)
        yield Path(tmp)


def rows_digest(frame: pd.DataFrame) -> str:
    """sha256 of a catalogue's rows (path, label, in order): what a shard or a whole catalogue is made of.
    An image replaced under the same name is not seen: content-addressed names are."""
    text = "\n".join(f"{p}\t{l}" for p, l in zip(frame["path"], frame["label"]))
    return hashlib.sha256(text.encode()).hexdigest()


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
