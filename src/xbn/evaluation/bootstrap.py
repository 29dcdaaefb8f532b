"""The paired bootstrap: is one model better than another on the same queries, beyond the noise of which
queries happened to be in the evaluation set?

Both models are scored on the same n queries (a per-query value: a Recall@k hit 1/0, an AP@R, ...). The
statistic is the mean of the per-query differences a_i - b_i; its sampling distribution is estimated by
resampling the n queries with replacement (each resample keeps a query's two scores together, which is what
makes it paired: query difficulty cancels out), and the interval is the percentile interval of the resampled
means (Efron & Tibshirani 1993, ch. 13). Pure numpy, vectorised over a (resamples, n) index matrix, a block of
resamples at a time so memory stays bounded for large n.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from xbn.utils.arrays import finite_array

# Indices drawn per block: 2**24 int64 = 128 MiB. A (1000, n) matrix fits in one block up to n ~ 16k.
_BLOCK_ELEMENTS = 1 << 24


class PairedInterval(NamedTuple):
    """mean(a - b) over the queries and its bootstrap percentile interval [low, high]."""

    difference: float
    low: float
    high: float


def paired_bootstrap(a: Any, b: Any, resamples: int = 1000, confidence: float = 0.95,
                     seed: int = 0) -> PairedInterval:
    """The paired-bootstrap percentile interval of mean(a - b) at `confidence` (see the module docstring).

    `a`, `b`: per-query scores of the two models on the same queries, in the same order (bools or numbers).
    Reproducible for a given `seed` (numpy's default generator). Identical vectors give (0, 0, 0).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence!r}")
    return percentile_interval(*bootstrap_means(a, b, resamples, seed), confidence)


def percentile_interval(diff: np.ndarray, means: np.ndarray, confidence: float) -> PairedInterval:
    """mean(diff) and the `confidence` percentile interval of the resampled `means`."""
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return PairedInterval(float(diff.mean()), float(low), float(high))


def bootstrap_means(a: Any, b: Any, resamples: int = 1000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The per-query differences a - b and the means of `resamples` paired resamples of them (the bootstrap
    distribution `paired_bootstrap` takes its interval from, and the gate's figure draws)."""
    a, b = _scores(a, "a"), _scores(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"a and b must score the same queries: got {len(a)} and {len(b)} scores")
    if len(a) == 0:
        raise ValueError("no queries to compare")
    if isinstance(resamples, bool) or int(resamples) != resamples or resamples < 1:
        raise ValueError(f"resamples must be a positive integer, got {resamples!r}")
    diff = a - b
    n, resamples = len(diff), int(resamples)
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    block = max(1, _BLOCK_ELEMENTS // n)
    for start in range(0, resamples, block):
        rows = min(block, resamples - start)
        means[start:start + rows] = diff[rng.integers(0, n, size=(rows, n))].mean(axis=1)
    return diff, means


def _scores(values: Any, name: str) -> np.ndarray:
    return finite_array(values, name, 1, "1-D (one score per query)", np.float64)
