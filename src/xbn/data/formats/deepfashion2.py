"""DeepFashion2 consumer-to-shop retrieval: `{train,validation}/image/NNNNNN.jpg` + `annos/NNNNNN.json`.

Every item with `style > 0` becomes one row cropped to its `bounding_box`, labelled
`{part}/{pair_id}_{category_id}_{style}` (a match is the same pair, category and style; the part prefix keeps
train and validation classes apart, since both number their pairs independently). Style 0 items are skipped:
they have no counterpart to match. `train/` rows go to split train (user and shop alike); in `validation/`,
user items are queries and shop items the gallery.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pandas as pd

from xbn.data.errors import DatasetError
from xbn.data.manifest import Box, build_manifest, check_box, safe_relative_path

PARTS = ("train", "validation")
SOURCES = ("user", "shop")
_ITEM = re.compile(r"item(\d+)")


def _int(obj: dict[str, Any], key: str, where: str) -> int:
    value = obj.get(key)
    # bool is an int subclass; a JSON true is not an id.
    if not isinstance(value, int) or isinstance(value, bool):
        raise DatasetError(f"{where}: '{key}' must be an integer, got {value!r}")
    return value


def _box(item: dict[str, Any], where: str) -> Box:
    box = item.get("bounding_box")
    if not isinstance(box, list) or len(box) != 4 or not all(isinstance(v, (int, float)) for v in box):
        raise DatasetError(f"{where}: 'bounding_box' must be [x1, y1, x2, y2], got {box!r}")
    x1, y1, x2, y2 = (round(v) for v in box)
    return check_box((x1, y1, x2, y2), where, None)


def read(root: Path) -> pd.DataFrame:
    present = [p for p in PARTS if (root / p / "annos").is_dir()]
    if not present:
        raise DatasetError(f"{root}: neither train/annos nor validation/annos exists (DeepFashion2 layout)")
    paths: list[str] = []
    labels: list[str] = []
    splits: list[str] = []
    boxes: list[Box | None] = []
    for part in present:
        for anno in sorted((root / part / "annos").glob("*.json")):
            try:
                data = json.loads(anno.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise DatasetError(f"cannot read annotation {anno}: {exc}") from exc
            if not isinstance(data, dict):
                raise DatasetError(f"{anno}: expected a JSON object")
            source = data.get("source")
            if source not in SOURCES:
                raise DatasetError(f"{anno}: 'source' is {source!r}, expected one of {list(SOURCES)}")
            pair_id = _int(data, "pair_id", str(anno))
            split = "train" if part == "train" else ("query" if source == "user" else "gallery")
            image = safe_relative_path(f"{part}/image/{anno.stem}.jpg", anno, None)
            items = sorted((int(m.group(1)), k) for k in data if (m := _ITEM.fullmatch(k)))
            for _, key in items:
                item, where = data[key], f"{anno}: {key}"
                if not isinstance(item, dict):
                    raise DatasetError(f"{where} is not an object")
                style = _int(item, "style", where)
                if style <= 0:
                    continue
                paths.append(image)
                labels.append(f"{part}/{pair_id}_{_int(item, 'category_id', where)}_{style}")
                splits.append(split)
                boxes.append(_box(item, where))
    return build_manifest(paths, labels, splits, boxes)
