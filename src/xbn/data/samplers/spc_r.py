"""`RandomBatchSampler`: SPC-R of Roth et al. 2020 (ICML, Sec. 4.3): b - 1 images drawn at random from the
training set, plus one image that shares a label with one of them, so every batch holds at least one positive
pair and otherwise has no class structure (the number of samples per class is itself random).

`draw` says how the b - 1 images are drawn:
- `image` (the default, the paper's "randomly sampled"): uniformly among the training images, so a class
  appears in proportion to its size;
- `class` (their reference `random_sampler`): each draw picks a class uniformly, then an image of it, so small
  classes are as frequent as large ones.

The b - 1 images are distinct (the reference code draws with replacement, so an image can repeat); the last
image is a *different* image of the class of a uniformly chosen member (theirs may draw the member itself,
leaving no real positive pair), taken among the members whose class still has an image outside the batch.
A pure function of (seed, epoch), like `ClassBalancedBatchSampler`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from xbn.data.errors import DatasetError
from xbn.data.sampler import EpochSeededBatchSampler

DRAWS = ("image", "class")


class RandomBatchSampler(EpochSeededBatchSampler):
    def __init__(self, labels: Sequence[int] | np.ndarray, batch_size: int, seed: int,
                 batches_per_epoch: int | None = None, draw: str = "image") -> None:
        n = len(labels)
        if batch_size < 2 or n < 2:
            raise ValueError(f"batch_size ({batch_size}) and the number of images ({n}) must be >= 2")
        if draw not in DRAWS:
            raise ValueError(f"draw must be one of {', '.join(DRAWS)}, got {draw!r}")
        super().__init__(seed, batches_per_epoch)
        _, self._codes = np.unique(np.asarray(labels), return_inverse=True)
        self._codes = self._codes.reshape(-1)
        self._members = np.split(np.argsort(self._codes, kind="stable"),
                                 np.cumsum(np.bincount(self._codes))[:-1])
        if max(len(m) for m in self._members) < 2:
            raise DatasetError("SPC-R needs a class with at least 2 images to add the batch's positive pair; "
                               "every class has a single image")
        self.num_images, self.draw = n, draw
        self.effective_batch_size = min(batch_size, n)
        self.batches_per_epoch = batches_per_epoch or max(1, n // self.effective_batch_size)

    def _random_images(self, rng: np.random.Generator, k: int) -> np.ndarray:
        """k distinct images: uniformly (`image`), or each of a uniformly drawn class that has one left."""
        if self.draw == "image":
            return rng.choice(self.num_images, size=k, replace=False)
        taken: set[int] = set()
        left = {c: len(m) for c, m in enumerate(self._members)}
        out: list[int] = []
        while len(out) < k:
            c = int(rng.integers(len(self._members)))
            if not left[c]:
                continue  # class used up in this batch: draw the class again
            free = [i for i in self._members[c] if i not in taken] if left[c] < len(self._members[c]) \
                else self._members[c]
            image = int(free[rng.integers(len(free))])
            taken.add(image)
            left[c] -= 1
            out.append(image)
        return np.asarray(out)

    def _partner(self, rng: np.random.Generator, batch: np.ndarray) -> int:
        """Another image of the class of a uniformly chosen member (members whose class has one left)."""
        in_batch = np.bincount(self._codes[batch], minlength=len(self._members))
        sizes = np.array([len(m) for m in self._members])
        open_members = batch[in_batch[self._codes[batch]] < sizes[self._codes[batch]]]
        if not len(open_members):  # every member's class is all in the batch: a pair is there already, unless
            # all b - 1 are single-image classes (then no image can pair with them: any image is added)
            return int(rng.choice(np.setdiff1d(np.arange(self.num_images), batch)))
        member = open_members[rng.integers(len(open_members))]
        others = np.setdiff1d(self._members[self._codes[member]], batch)
        return int(others[rng.integers(len(others))])

    def __iter__(self) -> Iterator[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        for _ in range(self.batches_per_epoch):
            batch = self._random_images(rng, self.effective_batch_size - 1)
            yield [*batch.tolist(), self._partner(rng, batch)]
