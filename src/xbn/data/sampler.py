"""`ClassBalancedBatchSampler`: P classes x M images per batch, a pure function of (seed, epoch).

PML's `MPerClassSampler` is not used: it draws from numpy's global RNG, whose state is neither private to
the sampler nor saved with a checkpoint, so a resumed run would see different batches. Here each epoch has
its own `numpy.random.Generator` seeded from `(seed, epoch)`, so resuming at an epoch reproduces it exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from xbn.data.errors import DatasetError


class EpochSeededBatchSampler:
    """What every batch sampler here shares: a length in batches and an epoch that, with the seed, fixes the
    epoch's batches (`set_epoch` before iterating; iterating does not advance it)."""

    batches_per_epoch: int  # the one asked for, or each subclass's default when None was

    def __init__(self, seed: int, batches_per_epoch: int | None) -> None:
        if seed < 0:
            raise ValueError(f"seed must be >= 0 (it seeds numpy's SeedSequence), got {seed}")
        if batches_per_epoch is not None and batches_per_epoch < 1:
            raise ValueError(f"batches_per_epoch must be >= 1, got {batches_per_epoch}")
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.batches_per_epoch


class ClassBalancedBatchSampler(EpochSeededBatchSampler):
    """Yield batches (lists of row indices) of `batch_size // samples_per_class` distinct classes, each with
    `samples_per_class` images; for `DataLoader(batch_sampler=...)`.

    Classes with fewer than `samples_per_class` images give all their images, topped up by sampling them with
    replacement; classes with a single image are skipped (they can form no positive pair) and counted in
    `num_skipped_classes`. If fewer usable classes exist than a batch asks for, every batch uses all of them,
    so batches are smaller (`effective_batch_size`). Classes are visited in shuffled rounds so each is drawn
    about equally often. The default length is about one pass over the usable images. Call
    `set_epoch(epoch)` before iterating each epoch; iterating does not advance it.
    """

    def __init__(
        self,
        labels: Sequence[int] | np.ndarray,
        batch_size: int,
        samples_per_class: int,
        seed: int,
        batches_per_epoch: int | None = None,
    ) -> None:
        if samples_per_class < 1 or batch_size < samples_per_class or batch_size % samples_per_class:
            raise ValueError(
                f"batch_size ({batch_size}) must be a positive multiple of "
                f"samples_per_class ({samples_per_class})"
            )
        super().__init__(seed, batches_per_epoch)
        _, codes = np.unique(np.asarray(labels), return_inverse=True)
        codes = codes.reshape(-1)
        groups = np.split(np.argsort(codes, kind="stable"), np.cumsum(np.bincount(codes))[:-1])
        self._groups = [g for g in groups if len(g) >= 2]
        self.num_skipped_classes = len(groups) - len(self._groups)
        if len(self._groups) < 2:
            raise DatasetError(
                f"need at least 2 classes with 2 or more images for class-balanced batches, found "
                f"{len(self._groups)} ({self.num_skipped_classes} single-image classes skipped)"
            )
        self.samples_per_class = samples_per_class
        self.classes_per_batch = min(batch_size // samples_per_class, len(self._groups))
        self.effective_batch_size = self.classes_per_batch * samples_per_class
        n_images = sum(len(g) for g in self._groups)
        self.batches_per_epoch = batches_per_epoch or max(1, n_images // self.effective_batch_size)

    def _draw(self, rng: np.random.Generator, members: np.ndarray) -> np.ndarray:
        m = self.samples_per_class
        if len(members) >= m:
            return rng.choice(members, size=m, replace=False)
        # Every image once, then repeats: pure replacement could return one image M times (no positive pair).
        return np.concatenate([rng.permutation(members), rng.choice(members, size=m - len(members))])

    def __iter__(self) -> Iterator[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        n, k = len(self._groups), self.classes_per_batch
        order, pos = rng.permutation(n), 0
        for _ in range(self.batches_per_epoch):
            if pos + k > len(order):
                # The classes left in this round come first; the next round's first classes that clash with
                # them move after this batch, so every round still draws each class exactly once.
                rest, fresh = order[pos:], rng.permutation(n)
                head = fresh[~np.isin(fresh, rest)][: k - len(rest)]
                order, pos = np.concatenate([rest, head, fresh[~np.isin(fresh, head)]]), 0
            batch = [self._draw(rng, self._groups[c]) for c in order[pos : pos + k]]
            pos += k
            yield np.concatenate(batch).tolist()
