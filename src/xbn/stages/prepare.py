"""Stage `prepare`: read the dataset in its own format, carve the validation classes, write the manifest."""

from __future__ import annotations

import logging
from pathlib import Path

from xbn.config import Params
from xbn.data import carve_validation, read_dataset, write_manifest

log = logging.getLogger(__name__)

# Fewer validation classes than this and the model is picked on noise: a random embedding already finds a
# same-class neighbour for most images, and val R@1 reaches 1.0 within an epoch or two (seen with 2 classes).
MIN_VAL_CLASSES = 5


def prepare(params: Params) -> dict:
    """Write `data.manifest` from the dataset at `data.root`. The previous manifest is removed first, so a
    prepare that fails (or is killed) leaves none: validate and train then stop on its absence instead of
    running on the data as it was before."""
    d = params.data
    Path(d.manifest).unlink(missing_ok=True)
    root = Path(d.root)
    if d.dataset == "glyphs":
        from xbn.data.glyphs import generate_glyphs

        g = d.glyphs
        generate_glyphs(root, classes=g.classes, images_per_class=g.images_per_class, image_size=g.image_size,
                        seed=g.seed)
    elif not root.exists():
        raise FileNotFoundError(f"data.root does not exist: {root}")
    options = {"seed": d.split_seed} if d.dataset == "folder" else {}
    frame = read_dataset(d.dataset, root, labels_file=d.labels_file, **options)
    frame = carve_validation(frame, d.val_classes, seed=d.split_seed)
    write_manifest(frame, d.manifest)
    summary = {
        split: {"images": len(part), "classes": int(part["label"].nunique())}
        for split, part in frame.groupby("split")
    }
    log.info("wrote %s: %s", d.manifest, summary)
    val_classes = summary.get("val", {}).get("classes", 0)
    if 0 < val_classes < MIN_VAL_CLASSES:
        log.warning("validation has %d classes (data.val_classes=%g of %d): the best epoch is chosen on its R@1, "
                    "which %d classes cannot tell apart; raise data.val_classes or add classes (at least %d)",
                    val_classes, d.val_classes, val_classes + summary.get("train", {}).get("classes", 0),
                    val_classes, MIN_VAL_CLASSES)
    return summary
