"""A generic image folder `root/<class>/*.{png,jpg,jpeg}` (extension case ignored), split class-disjointly:
a seeded `test_fraction` of the classes goes to test, the rest to train."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from xbn.data.errors import DatasetError
from xbn.data.manifest import build_manifest, pick_classes, safe_relative_path

EXTENSIONS = (".png", ".jpg", ".jpeg")


def read(root: Path, *, test_fraction: float = 0.5, seed: int = 0) -> pd.DataFrame:
    if not root.is_dir():
        raise DatasetError(f"image folder {root} is not a directory")
    files: dict[str, list[str]] = {}
    for class_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        names = sorted(
            f.name
            for f in class_dir.iterdir()
            if f.is_file() and f.suffix.lower() in EXTENSIONS and not f.name.startswith(".")
        )
        if names:
            files[class_dir.name] = names
    if len(files) < 2:
        raise DatasetError(f"{root}: need at least 2 class folders holding {'/'.join(EXTENSIONS)} images")
    test = set(pick_classes(files, test_fraction, seed))
    paths, labels, splits = [], [], []
    for cls, names in files.items():
        for name in names:
            paths.append(safe_relative_path(f"{cls}/{name}", root, None))
            labels.append(cls)
            splits.append("test" if cls in test else "train")
    return build_manifest(paths, labels, splits)
