"""Per-row columns that the expectation suite checks.

GX has no expectation for "the file exists" or "this class is also in the test split", and its pandas
backend cannot run a query across rows. So every such fact is computed here as one value per manifest row
(a missing value where it does not apply, which GX's column-map expectations skip), and the suite expects a
value set on it: a failure then names exactly the rows that break it.
"""

from __future__ import annotations

import hashlib
import io
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple, dataclass, fields
from pathlib import Path

import pandas as pd
from PIL import Image

from xbn.data.manifest import BOX_COLUMNS
from xbn.utils.progress import bar

# Sides of the class-disjoint protocol: no class may be on both.
TRAIN_SIDE = ("train", "val")
EVAL_SIDE = ("test", "query", "gallery")


@dataclass
class _ImageFacts:
    resolved: str | None = None
    inside_root: bool | None = None
    exists: bool | None = None
    decodes: bool | None = None
    decode_error: str | None = None
    width: int | None = None
    height: int | None = None
    mode: str | None = None  # PIL's mode (RGB, L, RGBA, P...): the drift report compares its distribution
    sha256: str | None = None


def _inspect(rel: object, root: Path) -> _ImageFacts:
    """Where `rel` resolves, and, only if that is inside `root`, whether it is a readable, decodable image."""
    if not isinstance(rel, str):  # null or non-text path: the not-null and type checks report it
        return _ImageFacts()
    try:
        target = (root / rel).resolve()  # follows symlinks, so a link out of the root is caught too
    except (OSError, RuntimeError, ValueError) as exc:  # symlink loop, NUL byte
        return _ImageFacts(resolved=str(root / rel), inside_root=True, exists=False, decode_error=str(exc))
    facts = _ImageFacts(resolved=str(target), inside_root=target.is_relative_to(root))
    if not facts.inside_root:
        return facts  # never open a file outside the dataset
    facts.exists = target.is_file()
    if not facts.exists:
        return facts
    try:
        data = target.read_bytes()
    except OSError as exc:
        facts.decodes, facts.decode_error = False, f"{type(exc).__name__}: {exc}"
        return facts
    facts.sha256 = hashlib.sha256(data).hexdigest()
    try:
        # verify() checks structure and checksums (catches corrupt PNGs) but decodes nothing; a truncated
        # JPEG only fails on a full load(), which needs a fresh handle because verify() consumes the image.
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            facts.width, facts.height = image.size
            facts.mode = image.mode
        facts.decodes = True
    except Exception as exc:  # noqa: BLE001 - PIL raises many types (OSError, SyntaxError, ValueError, DecompressionBomb...)
        facts.decodes, facts.decode_error = False, f"{type(exc).__name__}: {exc}"
    return facts


def image_columns(paths: pd.Series, root: str | Path, workers: int | None = None) -> pd.DataFrame:
    """Columns `resolved, inside_root, exists, decodes, decode_error, width, height, mode, sha256` for `paths`.

    The files are read in a thread pool: the work is file I/O and PIL decoding, which release the GIL.
    """
    root = Path(root).resolve()
    workers = workers or min(32, 4 * (os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        rows = list(bar(pool.map(lambda rel: astuple(_inspect(rel, root)), paths), "validate: read images",
                        total=len(paths), unit="image"))
    names = [f.name for f in fields(_ImageFacts)]
    raw = pd.DataFrame(rows, columns=names, index=paths.index, dtype=object)
    dtypes = {"inside_root": "boolean", "exists": "boolean", "decodes": "boolean", "width": "Int64",
              "height": "Int64"}
    return raw.astype(dtypes)


def class_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """Class facts per row, from `label` and `split`.

    - `train_class_images`: images of the row's class in `train` (train rows only; the sampler needs at
      least `samples_per_class` of them, a single image gives no positive pair).
    - `class_images`: images of the row's class in the row's split (query and gallery together): a test
      class with one image is a query without an answer.
    - `label_in_train_and_eval`: the class is on both sides of the protocol (train/val vs test/query/gallery).
    - `label_in_train_and_val`: the class is in both train and val (val must be unseen classes).
    - `label_splits`: the splits the class appears in (the detail shown for the rows above).
    """
    label, split = frame["label"], frame["split"]
    train = split == "train"
    counts = label[train].value_counts()
    out = pd.DataFrame(index=frame.index)
    out["train_class_images"] = label.map(counts).where(train).astype("Int64")
    # Every split's classes, query and gallery counted together (In-Shop's protocol: one query image of an
    # item is normal, its gallery images are its other images).
    group = split.where(~split.isin(("query", "gallery")), "query+gallery")
    key = (group.astype("string") + "\x00" + label.astype("string"))
    out["class_images"] = key.map(key.value_counts()).astype("Int64")

    def on_both(a: tuple[str, ...], b: tuple[str, ...]) -> set:
        return set(label[split.isin(a)].dropna()) & set(label[split.isin(b)].dropna())

    shared_eval, shared_val = on_both(TRAIN_SIDE, EVAL_SIDE), on_both(("train",), ("val",))
    out["label_in_train_and_eval"] = label.isin(shared_eval).astype("boolean")
    out["label_in_train_and_val"] = label.isin(shared_val).astype("boolean")
    flagged = label.isin(shared_eval | shared_val)
    splits_of = frame[flagged].groupby("label")["split"].agg(lambda s: ", ".join(sorted(set(s.dropna()))))
    out["label_splits"] = label.where(flagged).map(splits_of).astype(object)
    return out


def duplicate_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """`image_in_other_split`: the same bytes (and the same box, when boxes are given: two crops of one photo
    are different samples) also appear in another split; `duplicate_of` names one such row.

    Rows without a hash (missing or outside files) get a missing value: they are reported elsewhere.
    """
    key = frame["sha256"].astype(object)
    if all(c in frame.columns for c in BOX_COLUMNS):
        box = [frame[c].astype("string").fillna("") for c in BOX_COLUMNS]
        key = key + "@" + (box[0] + "," + box[1] + "," + box[2] + "," + box[3]).astype(object)
    known = key.notna()
    n_splits = frame[known].groupby(key[known])["split"].nunique()
    flagged = key.isin(n_splits.index[n_splits > 1])
    out = pd.DataFrame(index=frame.index)
    out["image_in_other_split"] = flagged.astype("boolean").where(known)
    duplicate_of = pd.Series(None, index=frame.index, dtype=object)
    for _, group in frame[flagged].groupby(key[flagged]):
        for idx, own in group["split"].items():
            other = group[group["split"] != own].iloc[0]
            duplicate_of.at[idx] = f"row {other.name} ({other['split']}): {other['path']}"
    out["duplicate_of"] = duplicate_of
    return out
