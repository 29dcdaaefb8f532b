"""Small clustered embeddings shared by the evaluation tests."""

from __future__ import annotations

import numpy as np
import pytest


def clustered(
    n_classes: int, per_class: int, dim: int, noise: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Unit vectors around random class centres, with class sizes varying between 1 and 2*per_class-1.

    The noise is chosen by each test so that neighbours of other classes interleave with the query's own
    (otherwise every metric would be 1.0 and prove nothing).
    """
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 2 * per_class, n_classes)
    labels = np.repeat(np.arange(n_classes), sizes)
    centres = rng.standard_normal((n_classes, dim))
    x = centres[labels] + noise * rng.standard_normal((len(labels), dim))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float32), labels


@pytest.fixture(name="clustered")
def clustered_fixture():
    """The `clustered` generator itself, for tests that need other sizes."""
    return clustered


@pytest.fixture
def clustered_with_ties() -> tuple[np.ndarray, np.ndarray]:
    """~250 embeddings in 50 classes, with exact duplicates inside classes and a label seen once."""
    x, labels = clustered(n_classes=50, per_class=5, dim=16, noise=1.2, seed=0)
    # Exact duplicates (same image twice, common in SOP) tie in similarity; placed within a class the order
    # among them cannot change any metric, so the brute-force reference stays well defined.
    rng = np.random.default_rng(1)
    for i in rng.choice(len(x), 20, replace=False):
        same = np.flatnonzero(labels == labels[i])
        x[same[0]] = x[i]
    x = np.concatenate([x, np.full((1, 16), 0.25, np.float32)])  # a unit vector of a label seen once
    labels = np.concatenate([labels, [999]])
    return x, labels
