"""CUB-200-2011: `images.txt` (`<image_id> <path under images/>`) + `image_class_labels.txt`
(`<image_id> <class_id>`). Metric-learning split: classes 1-100 train, 101-200 test (the classification
split in `train_test_split.txt` is ignored)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from xbn.data.errors import DatasetError
from xbn.data.formats._text import parse_int, read_lines, table
from xbn.data.manifest import build_manifest, safe_relative_path

TRAIN_CLASSES = 100


def read(root: Path) -> pd.DataFrame:
    images_txt, labels_txt = root / "images.txt", root / "image_class_labels.txt"
    images: dict[int, str] = {}
    for no, (image_id, rel) in table(read_lines(images_txt), ("image_id", "path"), images_txt, header=False):
        iid = parse_int(image_id, images_txt, no, "image_id")
        if iid in images:
            raise DatasetError(f"{images_txt} line {no}: duplicate image_id {iid}")
        images[iid] = "images/" + safe_relative_path(rel, images_txt, no)
    classes: dict[int, int] = {}
    for no, (image_id, class_id) in table(
        read_lines(labels_txt), ("image_id", "class_id"), labels_txt, header=False
    ):
        iid = parse_int(image_id, labels_txt, no, "image_id")
        cid = parse_int(class_id, labels_txt, no, "class_id")
        if iid not in images:
            raise DatasetError(f"{labels_txt} line {no}: image_id {iid} is not listed in {images_txt}")
        if cid < 1:
            raise DatasetError(f"{labels_txt} line {no}: class_id {cid} must be >= 1")
        classes[iid] = cid
    unlabelled = sorted(images.keys() - classes.keys())
    if unlabelled:
        raise DatasetError(f"{labels_txt}: no class_id for image_id {unlabelled[0]} (listed in {images_txt})")
    ids = sorted(images)
    return build_manifest(
        [images[i] for i in ids],
        [str(classes[i]) for i in ids],
        ["train" if classes[i] <= TRAIN_CLASSES else "test" for i in ids],
    )
