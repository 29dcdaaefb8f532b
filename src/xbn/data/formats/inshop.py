"""In-Shop Clothes Retrieval: `Eval/list_eval_partition.txt` = a count line, the header `image_name item_id
evaluation_status`, then rows (fields separated by any run of spaces). Splits train/query/gallery; label =
item_id. Queries are searched against the gallery only."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from xbn.data.errors import DatasetError
from xbn.data.formats._text import parse_int, read_lines, table
from xbn.data.manifest import build_manifest, safe_relative_path

COLUMNS = ("image_name", "item_id", "evaluation_status")
STATUSES = ("train", "query", "gallery")


def read(root: Path) -> pd.DataFrame:
    src = root / "Eval" / "list_eval_partition.txt"
    lines = read_lines(src)
    if not lines or len(lines[0][1]) != 1:
        raise DatasetError(f"{src} line 1: expected the image count alone on the first line")
    count = parse_int(lines[0][1][0], src, lines[0][0], "image count")
    rows = table(lines[1:], COLUMNS, src, header=True)
    # A short file is a truncated download; say so rather than silently evaluating on a subset.
    if count != len(rows):
        raise DatasetError(f"{src} line 1: says {count} images but the file lists {len(rows)}")
    paths, labels, splits = [], [], []
    for no, (name, item_id, status) in rows:
        if status not in STATUSES:
            raise DatasetError(
                f"{src} line {no}: evaluation_status {status!r} is not one of {list(STATUSES)}"
            )
        paths.append(safe_relative_path(name, src, no))
        labels.append(item_id)
        splits.append(status)
    return build_manifest(paths, labels, splits)
