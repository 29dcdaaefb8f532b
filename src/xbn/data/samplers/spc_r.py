"""`RandomBatchSampler`: SPC-R of Roth et al. 2020 (ICML, Sec. 4.3): batches drawn at random from the whole
training set with no class structure, so the number of samples per class in a batch is itself random (their
`random_sampler`). A pure function of (seed, epoch), like `ClassBalancedBatchSampler`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from xbn.data.sampler import EpochSeededBatchSampler


class RandomBatchSampler(EpochSeededBatchSampler):
    """Shuffle the training set each epoch and cut it into batches of `batch_size` (every image once per pass;
    a new shuffled pass starts when one runs out). A batch may hold few or no positive pairs: losses with a
    cross-batch memory still find positives there, plain pair losses may see a zero loss on such a batch."""

    def __init__(self, labels: Sequence[int] | np.ndarray, batch_size: int, seed: int,
                 batches_per_epoch: int | None = None) -> None:
        n = len(labels)
        if batch_size < 2 or n < 2:
            raise ValueError(f"batch_size ({batch_size}) and the number of images ({n}) must be >= 2")
        super().__init__(seed, batches_per_epoch)
        self.num_images = n
        self.effective_batch_size = min(batch_size, n)
        self.batches_per_epoch = batches_per_epoch or max(1, n // self.effective_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        b, order, pos = self.effective_batch_size, rng.permutation(self.num_images), 0
        for _ in range(self.batches_per_epoch):
            if pos + b > len(order):  # the pass's leftovers open the next pass (no image twice in a batch)
                rest, fresh = order[pos:], rng.permutation(self.num_images)
                order, pos = np.concatenate([rest, fresh[~np.isin(fresh, rest)]]), 0
            yield order[pos : pos + b].tolist()
            pos += b
