"""How a global batch reaches the processes of a data-parallel run, so that N processes see exactly what one
process would have seen.

- `RankBatchSampler` wraps the global batch sampler (identical on every rank: it is seeded from (seed, epoch))
  and yields this rank's contiguous slice of each global batch: rank r takes rows r*B/N to (r+1)*B/N, so
  gathering the slices in rank order gives back the global batch in its original order.
- Every row comes with its own augmentation seed, drawn from (seed, epoch, batch number, position in the
  global batch); `SeededSamples` seeds the RNGs with it before loading the row. A sample's augmentation then
  depends on that seed alone, not on which rank or DataLoader worker loads it or what was loaded before, so a
  run on N processes (or with any `num_workers`) augments every sample as the single-process run does.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
from torch.utils.data import Dataset

from xbn.data import ClassBalancedBatchSampler
from xbn.data.seeding import seeded_rngs

Row = tuple[int, int]  # (dataset index, augmentation seed)


class RankBatchSampler:
    """This rank's slice of every global batch of `batches`, as `(index, seed)` rows, for
    `DataLoader(SeededSamples(dataset), batch_sampler=...)`. Call `set_epoch(epoch)` before each epoch."""

    def __init__(self, batches: ClassBalancedBatchSampler, rank: int = 0, world_size: int = 1,
                 seed: int = 0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        if batches.effective_batch_size % world_size:
            raise ValueError(
                f"the global batch of {batches.effective_batch_size} rows (train.batch_size, capped by the "
                f"usable classes) cannot be split evenly over {world_size} processes")
        self.batches, self.rank, self.world_size, self.seed = batches, rank, world_size, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.batches.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[Row]]:
        for number, batch in enumerate(self.batches):
            seeds = np.random.SeedSequence([self.seed, self.epoch, number]).generate_state(len(batch))
            share = len(batch) // self.world_size
            lo, hi = self.rank * share, (self.rank + 1) * share
            yield [(int(i), int(s)) for i, s in zip(batch[lo:hi], seeds[lo:hi])]


class SizedDataset(Protocol):
    """A map-style dataset with a length (torch's Dataset leaves `__len__` out of its interface)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class SeededSamples(Dataset):
    """`dataset[(index, seed)]` is `dataset[index]` loaded under `seeded_rngs(seed)`."""

    def __init__(self, dataset: SizedDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, row: Row) -> Any:
        index, seed = row
        with seeded_rngs(seed):
            return self.dataset[index]


class RequestedBatches:
    """A batch sampler for the DataLoader that remembers the dataset indices of each batch it hands out, in
    order, so the training loop can name the rows of a batch that never arrived (images the dataset skipped
    as unreadable). The DataLoader delivers batches in the order it drew them, also with worker processes."""

    def __init__(self, batches: Any) -> None:
        self.batches = batches
        self._pending: collections.deque[list[int]] = collections.deque()

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[Any]]:
        self._pending.clear()
        for rows in self.batches:
            self._pending.append([int(r[0]) if isinstance(r, tuple) else int(r) for r in rows])
            yield rows

    def missing(self, received: Any) -> list[int]:
        """The indices of the oldest outstanding batch that are not in `received` (that batch's indices)."""
        requested = self._pending.popleft()
        got = {int(i) for i in received}
        return [i for i in requested if i not in got]
