"""Stanford Online Products: `Ebay_train.txt` / `Ebay_test.txt`, header `image_id class_id super_class_id
path`, space separated; the label is the class_id (test ids continue after the train ids, so disjoint)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from xbn.data.formats._text import parse_int, read_lines, table
from xbn.data.manifest import build_manifest, safe_relative_path

COLUMNS = ("image_id", "class_id", "super_class_id", "path")


def read(root: Path) -> pd.DataFrame:
    paths, labels, splits = [], [], []
    for name, split in (("Ebay_train.txt", "train"), ("Ebay_test.txt", "test")):
        src = root / name
        for no, (image_id, class_id, super_id, rel) in table(read_lines(src), COLUMNS, src, header=True):
            parse_int(image_id, src, no, "image_id")
            parse_int(super_id, src, no, "super_class_id")
            labels.append(str(parse_int(class_id, src, no, "class_id")))
            paths.append(safe_relative_path(rel, src, no))
            splits.append(split)
    return build_manifest(paths, labels, splits)
