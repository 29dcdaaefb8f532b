"""`ImageDataset`: the images of a manifest subset, as `(tensor, label, index)` for training and embedding."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from PIL import Image
from torch.utils.data import Dataset, default_collate
from torchvision.transforms.functional import to_tensor

from xbn.data.errors import DatasetError
from xbn.data.images import open_rgb
from xbn.data.manifest import BOX_COLUMNS, encode_labels

log = logging.getLogger(__name__)


class ImageDataset(Dataset):
    """Images listed in `manifest` (paths relative to `root`), cropped to their box when one is given.

    `labels` are the integer labels of the rows (default: `encode_labels` of the manifest's labels); the
    index is returned too so the memory bank and the evaluation can map outputs back to rows.
    `transform` maps an RGB PIL image to a tensor (default: `to_tensor`); transparent pixels arrive composited
    on white (`xbn.data.images.open_rgb`).

    `skip_unreadable`: an image that cannot be read (truncated or deleted after `validate` passed) is logged
    with its path and returned as None instead of raising; `collate_skipping` drops it from its batch.
    """

    def __init__(
        self,
        manifest: pd.DataFrame,
        root: str | Path,
        labels: Sequence[int] | np.ndarray | None = None,
        transform: Callable[[Image.Image], torch.Tensor] | None = None,
        skip_unreadable: bool = False,
    ) -> None:
        self.root = Path(root)
        self.skip_unreadable = skip_unreadable
        self.paths: list[str] = manifest["path"].astype(str).tolist()
        self.rows: list = manifest.index.tolist()  # the manifest's row labels: what messages name a row by
        self.labels = np.asarray(
            encode_labels(manifest["label"]) if labels is None else labels, dtype=np.int64
        )
        if self.labels.shape != (len(self.paths),):
            raise ValueError(f"{len(self.paths)} manifest rows but labels of shape {self.labels.shape}")
        # Plain lists, not the DataFrame: cheap to pickle into every DataLoader worker.
        self.boxes: list[tuple[int, int, int, int] | None] = [None] * len(self.paths)
        if all(c in manifest.columns for c in BOX_COLUMNS):
            for i, box in enumerate(manifest[list(BOX_COLUMNS)].itertuples(index=False)):
                if not any(pd.isna(v) for v in box):
                    self.boxes[i] = (int(box[0]), int(box[1]), int(box[2]), int(box[3]))
        self.transform = transform or to_tensor

    def __len__(self) -> int:
        return len(self.paths)

    def load(self, index: int) -> Image.Image:
        """The RGB image of row `index` (grey, palette and transparent images converted), cropped to its box."""
        path = self.root / self.paths[index]
        try:
            image = open_rgb(path, f"image {path.resolve()}")
        except (OSError, ValueError) as exc:  # open_rgb's UnreadableImage (every decoding failure), the file
            raise DatasetError(str(exc)) from exc  # system's, or a NUL byte in the path (ValueError)
        box = self.boxes[index]
        return image.crop(box) if box is not None else image

    def __getitem__(self, index: int) -> tuple[Any, int, int] | None:
        try:
            image = self.load(index)
        except DatasetError as exc:
            if not self.skip_unreadable:
                raise
            log.warning("skipping manifest row %s (%s): %s", self.rows[index], self.paths[index], exc)
            return None
        return self.transform(image), int(self.labels[index]), index


def loader_worker_init(worker_id: int) -> None:
    """`worker_init_fn` of xbn's DataLoaders: a forked worker forgets the thread-exit hooks of its parent.

    A worker started by fork inherits the hooks the parent registered with `threading._register_atexit`, which
    Python runs when the worker exits (`threading._shutdown` in `Process._bootstrap`). Inside a Prefect flow run
    the parent holds two: Prefect's APILogWorker (which ships log lines to the API) and EventsWorker each drain
    their queue at exit. Prefect's own at-fork handler resets those services in the child (no event loop, no
    done event), so the inherited drain fails `assert self._done_event is not None` as the worker exits. That
    happens in `_bootstrap`'s `finally`, past the handler that prints tracebacks, so the worker ends with exit
    code 1 and nothing on stderr: "DataLoader worker (pid ...) exited unexpectedly with exit code 1" at the end
    of every pass over a loader with `data.num_workers` > 0 (Prefect 3.8.8). The hooks belong to threads of the
    parent that do not exist in the worker, so dropping them loses nothing. Spawned or forkserver workers start
    with none; the list is private to CPython, hence the guard.
    """
    hooks = getattr(threading, "_threading_atexits", None)
    if isinstance(hooks, list):
        # Fork copied the parent's thread-exit hooks (Prefect's log/event drains): they fail here, exit code 1.
        hooks.clear()


def collate_skipping(samples: list[tuple[Any, int, int] | None]) -> tuple[torch.Tensor, ...]:
    """`default_collate` of the samples that are not None (a batch with a skipped image is just smaller);
    a batch whose every image was skipped is three empty tensors."""
    kept = [s for s in samples if s is not None]
    if not kept:
        return torch.empty(0), torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    return default_collate(kept)
