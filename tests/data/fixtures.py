"""Builders of tiny dataset trees in each format's exact on-disk layout (reused by later validation tests).

Each `write_*` function fills `root` and returns it; the images are real (decodable), a few pixels each,
with a colour derived from their class so crops and labels can be told apart.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from PIL import Image


def write_image(path: Path, size: tuple[int, int] = (24, 16), value: int = 128, mode: str = "RGB") -> Path:
    """A small solid image; the format follows the suffix (JPEG for .jpg/.jpeg)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fill = value if mode == "L" else (value, (value * 3) % 256, (value * 7) % 256)
    fmt = "JPEG" if path.suffix.lower() in (".jpg", ".jpeg") else "PNG"
    Image.new(mode, size, fill).save(path, format=fmt)
    return path


def write_cub(root: Path, classes: Iterable[int] = (1, 2, 101, 102), per_class: int = 2) -> Path:
    """CUB_200_2011/: images/NNN.Name/*.jpg, images.txt, image_class_labels.txt, classes.txt, and the
    classification split and boxes that the metric-learning reader ignores."""
    images, labels, names, split, boxes = [], [], [], [], []
    image_id = 0
    for cid in classes:
        folder = f"{cid:03d}.Bird_{cid}"
        names.append(f"{cid} {folder}")
        for j in range(per_class):
            image_id += 1
            rel = f"{folder}/Bird_{cid}_{j:04d}_{image_id}.jpg"
            write_image(root / "images" / rel, value=cid % 256)
            images.append(f"{image_id} {rel}")
            labels.append(f"{image_id} {cid}")
            split.append(f"{image_id} {j % 2}")
            boxes.append(f"{image_id} 1.0 2.0 10.0 8.0")
    for name, lines in (
        ("images.txt", images),
        ("image_class_labels.txt", labels),
        ("classes.txt", names),
        ("train_test_split.txt", split),
        ("bounding_boxes.txt", boxes),
    ):
        (root / name).write_text("\n".join(lines) + "\n")
    return root


def write_cars(
    root: Path, classes: Iterable[int] = (1, 2, 99, 100), per_class: int = 2, paths: list[str] | None = None
) -> Path:
    """car_ims/NNNNNN.jpg + cars_annos.mat with `annotations` (1 x N struct: relative_im_path, bbox_x1,
    bbox_y1, bbox_x2, bbox_y2, class, test) and `class_names`, as the real file. `paths` overrides the
    stored relative paths (to test path checks)."""
    from scipy.io import savemat

    fields = ["relative_im_path", "bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2", "class", "test"]
    classes = list(classes)
    rows = []
    for cid in classes:
        for _ in range(per_class):
            n = len(rows) + 1
            rel = f"car_ims/{n:06d}.jpg"
            write_image(root / rel, value=(cid * 5) % 256)
            rows.append((rel, 1, 2, 20, 14, cid, int(cid > 98)))
    if paths is not None:
        rows = [(p, *row[1:]) for p, row in zip(paths, rows, strict=True)]
    annotations = np.zeros((1, len(rows)), dtype=[(f, object) for f in fields])
    for i, (rel, x1, y1, x2, y2, cid, test) in enumerate(rows):
        annotations[0, i] = (
            np.array([rel]),
            *(np.array([[v]], dtype=np.uint8) for v in (x1, y1, x2, y2, cid, test)),
        )
    class_names = np.empty((1, max(classes)), dtype=object)
    class_names[0, :] = [np.array([f"Car {c}"]) for c in range(1, max(classes) + 1)]
    savemat(root / "cars_annos.mat", {"annotations": annotations, "class_names": class_names})
    return root


def write_sop(
    root: Path,
    train_classes: Iterable[int] = (1, 2, 3),
    test_classes: Iterable[int] = (4, 5),
    per_class: int = 2,
) -> Path:
    """Ebay_train.txt / Ebay_test.txt (header `image_id class_id super_class_id path`) + <x>_final/*.JPG."""
    image_id = 0
    for name, classes in (("Ebay_train.txt", train_classes), ("Ebay_test.txt", test_classes)):
        lines = ["image_id class_id super_class_id path"]
        for cid in classes:
            super_id = 1 + cid % 2
            for j in range(per_class):
                image_id += 1
                rel = f"{'bicycle' if super_id == 1 else 'chair'}_final/{111085122800 + cid}_{j}.JPG"
                write_image(root / rel, value=(cid * 9) % 256)
                lines.append(f"{image_id} {cid} {super_id} {rel}")
        (root / name).write_text("\n".join(lines) + "\n")
    return root


def write_inshop(
    root: Path, train_items: Iterable[int] = (2, 3), test_items: Iterable[int] = (7, 8, 9)
) -> Path:
    """Eval/list_eval_partition.txt (count line, header, rows padded with several spaces) + img/...jpg.
    Train items have 2 images; each test item has 1 query and 2 gallery images."""
    rows = []
    for item in train_items:
        rows += [(item, f"0{v}_1_front.jpg", "train") for v in (1, 2)]
    for item in test_items:
        rows += [
            (item, "01_1_front.jpg", "query"),
            (item, "01_2_side.jpg", "gallery"),
            (item, "02_1_front.jpg", "gallery"),
        ]
    lines = [str(len(rows)), "image_name item_id evaluation_status"]
    for item, name, status in rows:
        rel = f"img/WOMEN/Dresses/id_{item:08d}/{name}"
        write_image(root / rel, value=(item * 11) % 256)
        lines.append(f"{rel}          id_{item:08d}     {status}  ")
    (root / "Eval").mkdir(parents=True, exist_ok=True)
    (root / "Eval" / "list_eval_partition.txt").write_text("\n".join(lines) + "\n")
    return root


def _df2_item(category: int, style: int, box: list[int]) -> dict:
    return {
        "category_id": category,
        "category_name": "short sleeve top",
        "style": style,
        "bounding_box": box,
        "landmarks": [0] * 75,
        "segmentation": [[1, 1, 5, 1, 5, 5]],
        "scale": 2,
        "occlusion": 1,
        "zoom_in": 1,
        "viewpoint": 2,
    }


# (part, image number, source, pair_id, [(category_id, style, box)]): 7 matchable items, 2 of style 0.
DEEPFASHION2_ANNOS = [
    ("train", 1, "user", 1, [(1, 1, [2, 3, 20, 18]), (8, 0, [0, 0, 10, 10])]),
    ("train", 2, "shop", 1, [(1, 1, [0, 0, 30, 20])]),
    ("validation", 1, "user", 5, [(7, 2, [4, 4, 16, 12]), (1, 1, [1, 1, 9, 9])]),
    ("validation", 2, "shop", 5, [(7, 2, [0, 2, 24, 20])]),
    ("validation", 3, "shop", 5, [(1, 1, [3, 3, 13, 13]), (2, 0, [0, 0, 5, 5])]),
]


def write_deepfashion2(root: Path, annos: list = DEEPFASHION2_ANNOS) -> Path:
    """{train,validation}/image/NNNNNN.jpg (32x24) + annos/NNNNNN.json: source, pair_id, item1..itemN."""
    for part, number, source, pair_id, items in annos:
        write_image(root / part / "image" / f"{number:06d}.jpg", size=(32, 24), value=40 * number)
        data = {"source": source, "pair_id": pair_id}
        data.update({f"item{i}": _df2_item(*item) for i, item in enumerate(items, 1)})
        (root / part / "annos").mkdir(parents=True, exist_ok=True)
        (root / part / "annos" / f"{number:06d}.json").write_text(json.dumps(data))
    return root


def write_folder(
    root: Path, classes: Iterable[str] = ("ant", "bee", "cat", "dog"), per_class: int = 2
) -> Path:
    """root/<class>/<n>.<ext>, cycling through png, JPG and jpeg (extensions of any case count), plus a
    non-image file that must be ignored."""
    exts = (".png", ".JPG", ".jpeg")
    for c, name in enumerate(classes):
        for j in range(per_class):
            write_image(root / name / f"{j}{exts[(c + j) % len(exts)]}", value=30 * c)
        (root / name / "notes.txt").write_text("not an image")
    return root


def write_csv(root: Path, rows: list[tuple[str, str, str]] | None = None, name: str = "labels.csv") -> Path:
    """The generic layout (also the glyph generator's): images/<class>/<n>.png + labels.csv."""
    if rows is None:
        rows = [
            (f"images/{c}/{n}.png", c, split)
            for c, split in (("007", "train"), ("010", "train"), ("a b", "test"), ("NA", "test"))
            for n in range(2)
        ]
    for rel, label, _ in rows:
        write_image(root / rel, mode="L", value=len(label) * 50)
    (root / name).write_text("path,label,split\n" + "".join(f"{p},{lab},{s}\n" for p, lab, s in rows))
    return root
