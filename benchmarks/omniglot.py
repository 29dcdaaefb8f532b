"""Omniglot for the benchmarks: the background set exported once to PNG files, and a fixed class-disjoint split.

Omniglot's background set (964 characters x 20 drawings, 105 x 105, `../shared/data/omniglot/
images_background.npz` or `$XBN_OMNIGLOT_NPZ`, not part of the project) is exported once to `images/<class>/<i>.png` in a cache folder
outside the repository (`~/.cache/xbn-bench/omniglot`, or `$XBN_BENCH_CACHE`), and a `path,label,split` label
file (the project's `csv` dataset format) selects classes from a fixed split: 700 training characters (from
which the project's own `carve_validation` takes the validation classes) and 264 test characters. Used by
`benchmarks.grid`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
NPZ = Path(os.environ.get("XBN_OMNIGLOT_NPZ", REPO.parent / "shared" / "data" / "omniglot" / "images_background.npz"))
CACHE = Path(os.environ.get("XBN_BENCH_CACHE", Path.home() / ".cache" / "xbn-bench")) / "omniglot"
SPLIT_SEED = 0
TRAIN_CLASSES, TEST_CLASSES = 700, 264


def export(npz: Path = NPZ, out: Path = CACHE) -> Path:
    """Write every drawing as `images/<class>/<i>.png` (grayscale, ink black) once; returns the folder."""
    done = out / ".exported"
    if done.exists():
        return out
    from PIL import Image

    data = np.load(npz)
    images = data["images"]  # (964, 20, 105, 105) bool, True = white background
    for c in range(images.shape[0]):
        folder = out / "images" / f"c{c:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(images.shape[1]):
            Image.fromarray(images[c, i].astype(np.uint8) * 255, mode="L").save(folder / f"{i:02d}.png")
    done.write_text(f"{images.shape}\n")
    return out


def class_split(num_classes: int = 964, seed: int = SPLIT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """(700 training classes, 264 test classes), disjoint, from a fixed permutation."""
    order = np.random.default_rng(seed).permutation(num_classes)
    return np.sort(order[:TRAIN_CLASSES]), np.sort(order[TRAIN_CLASSES:TRAIN_CLASSES + TEST_CLASSES])


def write_labels(root: Path, path: Path, train_classes: int, test_classes: int, per_class: int) -> dict[str, int]:
    """A `path,label,split` file over the first `train_classes` / `test_classes` of the fixed split."""
    train, test = class_split()
    rows = ["path,label,split"]
    for split, classes in (("train", train[:train_classes]), ("test", test[:test_classes])):
        for c in classes:
            rows += [f"images/c{c:03d}/{i:02d}.png,c{c:03d},{split}" for i in range(per_class)]
    path.write_text("\n".join(rows) + "\n")
    return {"train_classes": int(min(train_classes, len(train))), "test_classes": int(min(test_classes, len(test)))}


def write_sop_like_labels(root: Path, path: Path, per_class: int = 5, seed: int = SPLIT_SEED) -> dict[str, int]:
    """Issue 42's SOP-like split: every one of the 964 characters, `per_class` of its 20 drawings (chosen by
    `seed`), the classes halved class-disjointly into train and test. Few images a class and a memory that
    holds many classes, as in Stanford Online Products (2 to 10 images a class)."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(964)
    rows = ["path,label,split"]
    for split, classes in (("train", order[:482]), ("test", order[482:])):
        for c in sorted(classes):
            rows += [f"images/c{c:03d}/{i:02d}.png,c{c:03d},{split}" for i in sorted(rng.choice(20, per_class,
                                                                                               replace=False))]
    path.write_text("\n".join(rows) + "\n")
    return {"train_classes": 482, "test_classes": 482}
