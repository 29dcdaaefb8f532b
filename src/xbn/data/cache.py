"""The decode cache (`data.cache`): every training image decoded once, stored uint8 in one memory-mapped file, so
that an epoch reads pixels instead of decoding and resizing JPEGs/PNGs with PIL in every worker.

What is stored, per manifest row of the training split: the image as `ImageDataset.load` gives it (RGB, cropped
to its box), resized exactly as the evaluation transform resizes (`build_transform(..., training=False)`'s
`Resize`: shorter side floor(image_size / 0.875), bilinear, PIL), as HWC uint8. Why that size:
- the eval-style transform of a cached image is then only the centre crop, so it equals the PIL path bit for
  bit (tests/data/test_cache.py);
- it is what timm's recipe treats as the image at the model's resolution: a random-resized crop of the whole
  image downsamples (crops of area 77% or more at 224 px), smaller crops upsample from the cached pixels; the
  originals of CUB/Cars/SOP are 300 to 500 px, so those crops are a little softer than from the original, a
  difference `xbn.data.tensor_transforms` documents with the others;
- it bounds the cache: 200 to 260 KB per image at 224 px (256 x 256 to 256 x 341, x 3), so CUB's 5,864 training
  images take ~1.5 GB, SOP's 59,551 ~12 to 15 GB (over `auto`'s budget, see below).

The file (`<cache dir>/decoded-<key>.xbnc`): an 8-byte magic padded to 64 bytes, the rows' pixels one after
another, the index (JSON: format, key, rule, and per row its offset, height and width, or null for an image that
could not be read), then a 24-byte trailer (magic, the index's offset and length). It is written to a temp file
beside it and renamed into place (`xbn.utils.io.atomic_path`): a killed build leaves no cache, only a temp file
that the next build removes. Workers open the file themselves (memory-mapped, read-only: the page cache holds
one copy for all of them).

The key is the content, never a path: the data's DVC md5 (`reports/data.json`, when it describes this manifest
and data.root) or, for data DVC does not track, every file's size and modification time; in both cases the
rows (paths relative to data.root, boxes) with their file sizes, the image size and the eval Resize, the resize
rule's version and the file format's. A changed image changes the md5 (or its size/mtime): a new cache file. A
renamed or moved data folder keeps its key (no path in it) as long as its files keep their times (`mv` does; a
copy gets new mtimes, so an untracked copy builds its own cache; a DVC-tracked one gets the md5 key back once its
snapshot, `reports/data.json`, names the new folder).

`data.cache`: true builds and uses it; false reads the images with PIL (`ImageDataset`, the reference);
auto uses it when the decoded set is at most `data.cache_max_gb` (an existing cache file for the key is used
whatever its size). Only for training: validation and evaluation read with PIL.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from xbn.data.dataset import ImageDataset, collate_skipping
from xbn.data.errors import DatasetError
from xbn.data.tensor_transforms import TensorAugment, TensorEval
from xbn.data.transforms import build_transform, eval_geometry
from xbn.utils.cache import cache_root
from xbn.utils.faults import fault_point
from xbn.utils.io import atomic_path

log = logging.getLogger(__name__)

FORMAT = "xbn-decode-cache/1"
RULE = "eval-resize/1"  # the resize rule's version: bump it when what is stored changes
MAGIC = b"XBNDEC01"
TRAILER = b"XBNIDX01"
DATA_OFFSET = 64
_TRAILER = struct.Struct("<8sQQ")
CHUNK = 64  # rows decoded at a time (bounds the build's memory)


def cache_dir() -> Path:
    """The decoded sets' folder: `decoded/` in xbn's cache (`xbn.utils.cache`)."""
    return cache_root() / "decoded"


def stored_resize(image_size: int):
    """The eval transform's own `Resize` (shorter side floor(image_size / 0.875), bilinear): what is stored."""
    return eval_geometry(build_transform(image_size, training=False, mean=(0, 0, 0), std=(1, 1, 1))).transforms[0]


def shorter_side(image_size: int) -> int:
    size = stored_resize(image_size).size
    return int(size if isinstance(size, int) else size[0])


def content_key(images: ImageDataset, image_size: int, data_md5: str | None) -> tuple[str, str]:
    """(key, what it is keyed on: 'dvc md5' or 'file sizes and mtimes') of the decoded `images` (see the
    module docstring)."""
    rows = []
    for path, box in zip(images.paths, images.boxes):
        try:
            st = (images.root / path).stat()
            stat: list[int] = [st.st_size] if data_md5 else [st.st_size, st.st_mtime_ns]
        except OSError:
            stat = []  # unreadable now: stored as missing; it keys as such
        rows.append([path, list(box) if box is not None else None, *stat])
    # the Resize itself too (size, interpolation, antialias): another timm resizing otherwise is another cache
    doc = {"format": FORMAT, "rule": RULE, "image_size": image_size, "resize": repr(stored_resize(image_size)),
           "data_md5": data_md5, "rows": rows}
    key = hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()
    return key, "dvc md5" if data_md5 else "file sizes and mtimes (data not tracked by DVC)"


def cache_path(key: str, folder: str | Path | None = None) -> Path:
    return Path(folder if folder is not None else cache_dir()) / f"decoded-{key[:40]}.xbnc"


def estimate_bytes(images: ImageDataset, image_size: int) -> int:
    """The decoded set's size from the image headers (no decoding): each row's (box) size resized to the stored
    shorter side."""
    side, total = shorter_side(image_size), 0
    for i, (path, box) in enumerate(zip(images.paths, images.boxes)):
        try:
            if box is not None:
                w, h = box[2] - box[0], box[3] - box[1]
            else:
                with Image.open(images.root / path) as im:
                    w, h = im.size
        except (OSError, ValueError):
            continue
        short, long = max(min(w, h), 1), max(w, h)
        total += 3 * side * int(side * long / short)
    return total


def _decode(images: ImageDataset, resize, index: int) -> np.ndarray | None:
    try:
        return np.asarray(resize(images.load(index)), dtype=np.uint8)
    except DatasetError as exc:
        log.warning("decode cache: manifest row %s (%s) left out: %s", images.rows[index], images.paths[index], exc)
        return None


def build(images: ImageDataset, image_size: int, path: str | Path, key: str, threads: int = 1) -> Path:
    """Decode, resize and store every row of `images` at `path` (atomically). `threads`: decoding threads (PIL
    releases the GIL while it decodes and resizes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    resize = stored_resize(image_size)
    started = time.perf_counter()
    offsets: list[int | None] = []
    shapes: list[list[int] | None] = []
    n = len(images)
    with atomic_path(path) as tmp, open(tmp, "wb") as fh, ThreadPoolExecutor(max(1, threads)) as pool:
        fh.write(MAGIC.ljust(DATA_OFFSET, b"\0"))
        position = 0
        for lo in range(0, n, CHUNK):
            for array in pool.map(lambda i: _decode(images, resize, i), range(lo, min(n, lo + CHUNK))):
                if array is None:
                    offsets.append(None)
                    shapes.append(None)
                    continue
                offsets.append(position)
                shapes.append([int(array.shape[0]), int(array.shape[1])])
                fh.write(np.ascontiguousarray(array).tobytes())
                position += array.nbytes
            if lo < n // 2 <= lo + CHUNK:
                fh.flush()
                fault_point("cache.after_rows")  # a build killed midway (tests/data/test_cache.py)
        index = json.dumps({"format": FORMAT, "key": key, "rule": RULE, "image_size": image_size,
                            "shorter_side": shorter_side(image_size), "rows": n, "offsets": offsets,
                            "shapes": shapes}).encode()
        fh.write(index)
        fh.write(_TRAILER.pack(TRAILER, DATA_OFFSET + position, len(index)))
        fh.flush()
    log.info("decode cache: %d images, %.2f GB, built in %.1f s: %s", n - offsets.count(None), position / 1e9,
             time.perf_counter() - started, path)
    return path


def read_index(path: str | Path) -> dict[str, Any]:
    """The index of the cache file at `path`; a DatasetError when it is not a complete cache file."""
    path = Path(path)
    with open(path, "rb") as fh:
        head = fh.read(len(MAGIC))
        fh.seek(-_TRAILER.size, os.SEEK_END)
        magic, offset, length = _TRAILER.unpack(fh.read(_TRAILER.size))
        if head != MAGIC or magic != TRAILER:
            raise DatasetError(f"{path} is not an xbn decode cache")
        fh.seek(offset)
        index = json.loads(fh.read(length))
    if index.get("format") != FORMAT:
        raise DatasetError(f"{path}: decode cache format {index.get('format')!r}, expected {FORMAT}")
    index["data_bytes"] = offset - DATA_OFFSET
    return index


class DecodedImages:
    """The rows of a cache file, read through a memory map that each process opens for itself (pickling this
    object, as DataLoader workers do, sends the path and the index, never the pixels)."""

    def __init__(self, path: str | Path, key: str | None = None) -> None:
        self.path = Path(path)
        index = read_index(self.path)
        if key is not None and index["key"] != key:
            raise DatasetError(f"{self.path} holds the decode cache of key {index['key'][:12]}, not {key[:12]}")
        self.key = index["key"]
        self.offsets: list[int | None] = index["offsets"]
        self.shapes: list[list[int] | None] = index["shapes"]
        self.data_bytes = int(index["data_bytes"])
        self._map: np.memmap | None = None

    def __len__(self) -> int:
        return len(self.offsets)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_map": None}

    def image(self, index: int) -> np.ndarray | None:
        """Row `index` as a read-only HWC uint8 view of the file, None for an image that was unreadable."""
        offset, shape = self.offsets[index], self.shapes[index]
        if offset is None or shape is None:
            return None
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r", offset=DATA_OFFSET,
                                  shape=(max(self.data_bytes, 1),))
        h, w = shape
        return self._map[offset:offset + h * w * 3].reshape(h, w, 3)


Mode = Literal["train", "train_device", "eval"]


class CachedImageDataset(Dataset):
    """`ImageDataset`'s interface over a decode cache: `(sample, label, index)`, None for a row that could not be
    read (with `skip_unreadable`; else a DatasetError). Batch it with `collate`.

    mode `train`: a sample is `{"pixels": uint8 (3, S, S) crop, "params": its augmentation draws}`
    (`TensorAugment.sample`) and `collate` runs the batch stage (`TensorAugment.color_batch`) in the loader's
    process, giving normalised float images; `train_device`: `collate` leaves the batch as that dict, for
    `TensorAugment.color_batch` on the training device; `eval`: centre crop and normalisation (`TensorEval`)."""

    def __init__(self, decoded: DecodedImages, images: ImageDataset, image_size: int, mean: Sequence[float],
                 std: Sequence[float], mode: Mode = "train", augment: Literal["full", "light"] = "full",
                 skip_unreadable: bool = False) -> None:
        if len(decoded) != len(images):
            raise DatasetError(f"{decoded.path}: {len(decoded)} rows, the manifest subset has {len(images)}")
        self.decoded, self.mode, self.skip_unreadable = decoded, mode, skip_unreadable
        self.paths, self.rows, self.labels = images.paths, images.rows, images.labels
        self.augment = TensorAugment(image_size, mean, std, augment)
        self.eval = TensorEval(image_size, mean, std)

    def __len__(self) -> int:
        return len(self.paths)

    def pixels(self, index: int) -> torch.Tensor | None:
        """Row `index` as a uint8 CHW tensor (a copy: the map is read-only), None when it was unreadable."""
        array = self.decoded.image(index)
        return None if array is None else torch.from_numpy(np.array(array)).permute(2, 0, 1)

    def __getitem__(self, index: int) -> tuple[Any, int, int] | None:
        image = self.pixels(index)
        if image is None:
            message = f"manifest row {self.rows[index]} ({self.paths[index]}) was unreadable when the decode cache "\
                      f"{self.decoded.path.name} was built"
            if not self.skip_unreadable:
                raise DatasetError(message)
            log.warning("skipping %s", message)
            return None
        label = int(self.labels[index])
        if self.mode == "eval":
            return self.eval(image), label, index
        crop, params = self.augment.sample(image)
        return {"pixels": crop, "params": params}, label, index

    def collate(self, samples: list[tuple[Any, int, int] | None]) -> tuple[Any, ...]:
        """`collate_skipping`, then (mode `train`) the batch stage of the augmentation."""
        images, labels, indices = collate_skipping(samples)
        if self.mode == "train" and isinstance(images, dict):
            images = self.augment.color_batch(images["pixels"], images["params"])
        return images, labels, indices


def decoded_bytes_budget(max_gb: float) -> int:
    return int(max_gb * 1e9)


def prepare(images: ImageDataset, image_size: int, setting: bool | str, max_gb: float, data_md5: str | None,
            threads: int = 1, folder: str | Path | None = None) -> dict[str, Any]:
    """Decide, and build when needed, the decode cache of `images` for `data.cache` = `setting`; returns a
    record: `path` (None: read with PIL) and why."""
    if setting is False:
        return {"path": None, "reason": "data.cache=false"}
    key, keyed_on = content_key(images, image_size, data_md5)
    path = cache_path(key, folder)
    record = {"key": key, "keyed_on": keyed_on, "shorter_side": shorter_side(image_size), "rule": RULE}
    if path.exists():
        try:
            read_index(path)
            return {**record, "path": str(path), "reason": "found", "built_s": 0.0}
        except (DatasetError, OSError, ValueError, struct.error) as exc:
            log.warning("decode cache %s unusable (%s): rebuilt", path, exc)
    if setting == "auto":
        needed = estimate_bytes(images, image_size)
        if needed > decoded_bytes_budget(max_gb):
            log.info("data.cache=auto: the decoded training set would take %.1f GB > data.cache_max_gb=%g: "
                     "images are read with PIL", needed / 1e9, max_gb)
            return {**record, "path": None, "reason": f"{needed / 1e9:.1f} GB > data.cache_max_gb"}
    started = time.perf_counter()
    build(images, image_size, path, key, threads)
    return {**record, "path": str(path), "reason": "built", "built_s": round(time.perf_counter() - started, 2)}
