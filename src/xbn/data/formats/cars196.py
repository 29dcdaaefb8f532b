"""CARS196: `cars_annos.mat`, a 1 x N struct array `annotations` (relative_im_path, bbox_x1..bbox_y2, class,
test). Metric-learning split: classes 1-98 train, 99-196 test; images are used whole, as in the DML papers."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from xbn.data.errors import DatasetError
from xbn.data.manifest import build_manifest, safe_relative_path

TRAIN_CLASSES = 98


def read(root: Path) -> pd.DataFrame:
    from scipy.io import loadmat

    src = root / "cars_annos.mat"
    try:
        mat = loadmat(src)
    except Exception as exc:  # loadmat reports corrupt files through many exception types (IndexError too)
        raise DatasetError(f"cannot read {src}: {exc}") from exc
    if "annotations" not in mat:
        raise DatasetError(f"{src}: no 'annotations' variable (has {sorted(k for k in mat if k[0] != '_')})")
    annotations = mat["annotations"].ravel()
    # Fields by name rather than position (a[0][0], a[5][0][0]): the same on the real file, clearer if not.
    fields = annotations.dtype.names or ()
    for key in ("relative_im_path", "class"):
        if key not in fields:
            raise DatasetError(f"{src}: annotations lack field '{key}' (fields: {list(fields)})")
    paths, labels, splits = [], [], []
    for no, ann in enumerate(annotations, 1):
        where = f"{src} annotation #{no}"
        try:
            rel = str(ann["relative_im_path"].ravel()[0])
            cid = int(ann["class"].ravel()[0])
        except (IndexError, TypeError, ValueError):
            raise DatasetError(f"{where}: unreadable relative_im_path or class") from None
        if cid < 1:
            raise DatasetError(f"{where}: class {cid} must be >= 1")
        paths.append(safe_relative_path(rel, where, None))
        labels.append(str(cid))
        splits.append("train" if cid <= TRAIN_CLASSES else "test")
    return build_manifest(paths, labels, splits)
