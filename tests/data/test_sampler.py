"""ClassBalancedBatchSampler: P x M batches, reproducible from (seed, epoch); small and singleton classes."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from xbn.data import ClassBalancedBatchSampler, DatasetError


def _labels(sizes: list[int]) -> np.ndarray:
    return np.repeat(np.arange(len(sizes)), sizes)


def _structure(batch: list[int], labels: np.ndarray) -> list[int]:
    return sorted(Counter(labels[batch].tolist()).values())


def test_batches_have_p_classes_of_m_images():
    labels = _labels([10] * 12)
    sampler = ClassBalancedBatchSampler(labels, batch_size=16, samples_per_class=4, seed=0)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 120 // 16  # about one pass over the images
    for batch in batches:
        assert len(batch) == 16 and _structure(batch, labels) == [4, 4, 4, 4]
        assert len(set(batch)) == 16  # no repeats when classes are large enough


def test_reproducible_from_seed_and_epoch():
    labels = _labels([5, 7, 3, 9, 6, 4, 8])
    make = lambda seed: ClassBalancedBatchSampler(labels, 8, 2, seed=seed, batches_per_epoch=20)  # noqa: E731
    a, b = make(1), make(1)
    a.set_epoch(3)
    b.set_epoch(3)
    assert list(a) == list(b) == list(a)  # iterating does not advance the epoch
    a.set_epoch(4)
    assert list(a) != list(b)
    assert list(make(2)) != list(make(1))
    state = np.random.get_state()
    list(make(1))
    assert np.array_equal(np.random.get_state()[1], state[1])  # the global RNG is untouched


def test_small_classes_filled_with_replacement_and_singletons_skipped():
    labels = _labels([1, 2, 3, 1, 6])  # classes 0 and 3 have one image
    sampler = ClassBalancedBatchSampler(
        labels, batch_size=8, samples_per_class=4, seed=0, batches_per_epoch=30
    )
    assert sampler.num_skipped_classes == 2
    for batch in sampler:
        assert _structure(batch, labels) == [4, 4]
        for cls, idx in _group(batch, labels).items():
            assert cls not in (0, 3)
            # every image of a small class appears before any repeats
            assert set(idx) == set(np.flatnonzero(labels == cls)) or len(set(idx)) == 4


def _group(batch, labels):
    out: dict[int, list[int]] = {}
    for i in batch:
        out.setdefault(int(labels[i]), []).append(i)
    return out


def test_fewer_usable_classes_than_requested_gives_smaller_batches():
    labels = _labels([4, 4, 4])
    sampler = ClassBalancedBatchSampler(labels, batch_size=32, samples_per_class=4, seed=0)
    assert (sampler.classes_per_batch, sampler.effective_batch_size, len(sampler)) == (3, 12, 1)
    assert _structure(next(iter(sampler)), labels) == [4, 4, 4]


def test_classes_drawn_about_equally_often():
    labels = _labels([20] * 10)
    sampler = ClassBalancedBatchSampler(
        labels, batch_size=12, samples_per_class=4, seed=5, batches_per_epoch=100
    )
    counts = Counter(
        int(labels[b[0]]) for batch in sampler for b in [batch[i : i + 4] for i in range(0, 12, 4)]
    )
    assert set(counts.values()) == {30}  # shuffled rounds: 300 class draws spread exactly over 10 classes


def test_argument_errors():
    with pytest.raises(
        ValueError, match=r"batch_size \(10\) must be a positive multiple of samples_per_class \(4\)"
    ):
        ClassBalancedBatchSampler(_labels([4, 4]), 10, 4, seed=0)
    with pytest.raises(
        DatasetError, match=r"at least 2 classes .* found 1 \(2 single-image classes skipped\)"
    ):
        ClassBalancedBatchSampler(_labels([1, 5, 1]), 8, 4, seed=0)
    with pytest.raises(ValueError, match=r"seed must be >= 0"):
        ClassBalancedBatchSampler(_labels([4, 4]), 8, 4, seed=-1)
