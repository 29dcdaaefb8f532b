"""Rank slices of the global batch and per-sample augmentation seeds (no processes needed)."""

import random

import numpy as np
import pytest
import torch

from xbn.data import ClassBalancedBatchSampler
from xbn.training.batches import RankBatchSampler, SeededSamples

LABELS = np.repeat(np.arange(10), 4)


def epoch_of(sampler: RankBatchSampler, epoch: int) -> list[list[tuple[int, int]]]:
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_slices_in_rank_order_are_the_global_batch(world_size):
    def sampler(rank, world):
        return RankBatchSampler(ClassBalancedBatchSampler(LABELS, 16, 4, seed=3), rank, world, seed=3)

    for epoch in (0, 1):
        whole = epoch_of(sampler(0, 1), epoch)
        slices = [epoch_of(sampler(r, world_size), epoch) for r in range(world_size)]
        assert len(whole) == len(slices[0]) == 2
        for b, batch in enumerate(whole):
            assert [row for s in slices for row in s[b]] == batch  # indices and seeds, in order
            assert all(len(s[b]) == 16 // world_size for s in slices)
    # Seeds differ between positions, batches and epochs.
    rows = epoch_of(sampler(0, 1), 0) + epoch_of(sampler(0, 1), 1)
    seeds = [seed for batch in rows for _, seed in batch]
    assert len(set(seeds)) == len(seeds)


def test_global_batch_must_split_evenly():
    with pytest.raises(ValueError, match="global batch of 12 rows .* cannot be split evenly over 8"):
        RankBatchSampler(ClassBalancedBatchSampler(LABELS, 12, 4, seed=0), 0, 8)
    with pytest.raises(ValueError, match="rank 2 is outside a world of 2"):
        RankBatchSampler(ClassBalancedBatchSampler(LABELS, 16, 4, seed=0), 2, 2)


class Draws(torch.utils.data.Dataset):
    """Draws from each RNG timm's augmentations use."""

    def __len__(self):
        return 5

    def __getitem__(self, index):
        return index, random.random(), float(np.random.rand()), float(torch.rand(()))


def test_seeded_sample_depends_on_its_seed_alone_and_leaves_global_rngs_alone():
    samples = SeededSamples(Draws())
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    alone = samples[(2, 77)]
    after = random.random(), float(np.random.rand()), float(torch.rand(()))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    for row in [(0, 5), (4, 9), (1, 123)]:  # other samples first, as another rank or worker would load them
        samples[row]
    assert samples[(2, 77)] == alone
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == after
    assert samples[(2, 78)] != alone
