"""The manifest: one table (`path,label,split[,x1,y1,x2,y2]`) that every dataset format is read into.

`path` is relative to the dataset root (POSIX), `label` a string (class id or name), `split` one of `SPLITS`;
the optional box columns are integers, empty when the image is used whole. Later stages read only this table,
so format quirks stay inside `xbn.data.formats`.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath

import numpy as np
import pandas as pd

from xbn.data.errors import DatasetError
from xbn.utils.io import atomic_path

SPLITS = ("train", "val", "test", "query", "gallery")
COLUMNS = ("path", "label", "split")
BOX_COLUMNS = ("x1", "y1", "x2", "y2")

Box = tuple[int, int, int, int]


def _where(source: str | Path, line_no: int | None) -> str:
    return f"{source} line {line_no}" if line_no is not None else str(source)


def safe_relative_path(text: str, source: str | Path, line_no: int | None) -> str:
    """Return `text` as a normalized POSIX path relative to the dataset root.

    A label file must not reach outside its root: absolute paths (POSIX, UNC or with a Windows drive letter)
    and `..` components raise `DatasetError` naming `source` and `line_no`. Backslashes count as separators
    so that lists written on Windows read the same.
    """
    raw = text.strip()
    where = _where(source, line_no)
    if not raw:
        raise DatasetError(f"{where}: empty image path")
    if any(ord(c) < 32 for c in raw):  # a NUL byte crashed the job (ValueError); a newline breaks every log line
        raise DatasetError(f"{where}: image path {raw!r} holds a control character")
    win = PureWindowsPath(raw)
    if PurePosixPath(raw).is_absolute() or win.drive or win.root:
        raise DatasetError(
            f"{where}: image path {raw!r} is absolute; paths must be relative to the dataset root"
        )
    parts = raw.replace("\\", "/").split("/")
    if ".." in parts:
        raise DatasetError(
            f"{where}: image path {raw!r} contains '..'; paths must stay inside the dataset root"
        )
    clean = "/".join(p for p in parts if p not in ("", "."))
    if not clean:
        raise DatasetError(f"{where}: image path {raw!r} names no file")
    return clean


def build_manifest(
    paths: Sequence[str],
    labels: Sequence[str],
    splits: Sequence[str],
    boxes: Sequence[Box | None] | None = None,
) -> pd.DataFrame:
    """Assemble manifest columns with their dtypes (strings; nullable Int64 boxes, NA = whole image)."""
    df = pd.DataFrame(
        {
            "path": pd.Series(paths, dtype=str),
            "label": pd.Series(labels, dtype=str),
            "split": pd.Series(splits, dtype=str),
        }
    )
    if boxes is not None:
        whole = (None,) * len(BOX_COLUMNS)
        for j, name in enumerate(BOX_COLUMNS):
            df[name] = pd.array([(b or whole)[j] for b in boxes], dtype="Int64")
    return df


def _parse_box(values: Sequence[str], source: str | Path, line_no: int | None) -> Box | None:
    texts = [str(v).strip() for v in values]
    if not any(texts):
        return None
    try:
        x1, y1, x2, y2 = (int(t) for t in texts)
    except ValueError:
        raise DatasetError(
            f"{_where(source, line_no)}: box x1,y1,x2,y2 must be four integers or all empty, got {texts}"
        ) from None
    return check_box((x1, y1, x2, y2), source, line_no)


def check_box(box: Box, source: str | Path, line_no: int | None) -> Box:
    """Refuse boxes that would crop to nothing, naming where they came from."""
    x1, y1, x2, y2 = box
    if x1 < 0 or y1 < 0 or x2 <= x1 or y2 <= y1:
        raise DatasetError(
            f"{_where(source, line_no)}: box {list(box)} is empty or negative "
            "(need 0 <= x1 < x2 and 0 <= y1 < y2)"
        )
    return box


def read_manifest(path: str | Path) -> pd.DataFrame:
    """Read and check a manifest CSV (also the generic `path,label,split` label file).

    Extra columns are ignored; labels stay strings (`"007"` is not 7); every path goes through
    `safe_relative_path`. Problems raise `DatasetError` naming the file, the line and the column.
    """
    path = Path(path)
    try:
        fh = path.open(newline="", encoding="utf-8")
    except OSError as exc:
        raise DatasetError(f"cannot read label file {path}: {exc.strerror or exc}") from exc
    try:
        with fh:
            return _read_rows(csv.reader(fh), path)
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except csv.Error as exc:
        raise DatasetError(f"{path}: not a readable CSV file ({exc})") from None


def _read_rows(reader, path: Path) -> pd.DataFrame:
    """The manifest of a `csv.reader` over `path` (see `read_manifest`)."""
    paths: list[str] = []
    labels: list[str] = []
    splits: list[str] = []
    boxes: list[Box | None] = []
    header = [h.strip() for h in next(reader, [])]
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise DatasetError(f"{path} line 1: header {header} lacks column(s) {missing}")
    box_cols = [c for c in BOX_COLUMNS if c in header]
    if box_cols and len(box_cols) != len(BOX_COLUMNS):
        raise DatasetError(f"{path} line 1: box columns must be all of {list(BOX_COLUMNS)} or none")
    col = {c: header.index(c) for c in (*COLUMNS, *box_cols)}
    for row in reader:
        line = reader.line_num
        if not any(f.strip() for f in row):
            continue
        if len(row) != len(header):
            raise DatasetError(
                f"{path} line {line}: expected {len(header)} fields ({header}), got {len(row)}"
            )
        label, split = row[col["label"]].strip(), row[col["split"]].strip()
        if not label:
            raise DatasetError(f"{path} line {line}: empty 'label'")
        if split not in SPLITS:
            raise DatasetError(
                f"{path} line {line}: 'split' is {split!r}, expected one of {list(SPLITS)}"
            )
        paths.append(safe_relative_path(row[col["path"]], path, line))
        labels.append(label)
        splits.append(split)
        if box_cols:
            boxes.append(_parse_box([row[col[c]] for c in box_cols], path, line))
    if not paths:
        raise DatasetError(f"{path}: no rows after the header")
    return build_manifest(paths, labels, splits, boxes if box_cols else None)


def check_manifest(df: pd.DataFrame, source: str = "manifest") -> None:
    """Check an in-memory manifest's columns and split values; an error names the first bad row."""
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise DatasetError(f"{source}: missing column(s) {missing}; has {list(df.columns)}")
    bad = ~df["split"].isin(SPLITS)
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        raise DatasetError(
            f"{source} row {row}: 'split' is {df['split'].iloc[row]!r}, expected one of {list(SPLITS)}"
        )
    present = [c for c in BOX_COLUMNS if c in df.columns]
    if present and len(present) != len(BOX_COLUMNS):
        raise DatasetError(f"{source}: box columns must be all of {list(BOX_COLUMNS)} or none, got {present}")


def write_manifest(df: pd.DataFrame, path: str | Path) -> None:
    """Write the manifest columns (boxes only if present) atomically, so a reader never sees half a file."""
    check_manifest(df, str(path))
    cols = list(COLUMNS) + [c for c in BOX_COLUMNS if c in df.columns]
    with atomic_path(path) as tmp:
        df[cols].to_csv(tmp, index=False)


def pick_classes(classes: Iterable[str], fraction: float, seed: int) -> list[str]:
    """A seeded `fraction` of the distinct `classes`, sorted.

    At least one class when `fraction > 0` and there are two or more, and never all of them, so both sides
    of a class-disjoint split are non-empty. The classes are sorted before drawing so the choice depends only
    on the set of classes and the seed, not on row order.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    pool = sorted(set(classes))
    if fraction == 0.0 or len(pool) < 2:
        return []
    n = min(max(1, round(fraction * len(pool))), len(pool) - 1)
    picked = np.random.default_rng(seed).choice(len(pool), size=n, replace=False)
    return sorted(pool[i] for i in picked)


def carve_validation(df: pd.DataFrame, fraction: float, seed: int) -> pd.DataFrame:
    """Move a seeded, class-disjoint `fraction` of the train classes to split `val` (a copy is returned).

    Whole classes move, so validation measures retrieval of unseen classes as the test protocol does;
    test/query/gallery rows are never touched.
    """
    check_manifest(df)
    train = df["split"] == "train"
    chosen = pick_classes(df.loc[train, "label"], fraction, seed)
    out = df.copy()
    out.loc[train & out["label"].isin(chosen), "split"] = "val"
    return out


def encode_labels(labels: Iterable[str]) -> np.ndarray:
    """Map label strings to int64 codes by their sorted unique order (stable for a given set of labels)."""
    _, codes = np.unique(np.asarray([str(v) for v in labels], dtype=str), return_inverse=True)
    return codes.reshape(-1).astype(np.int64)
