"""Distance-distribution matching batches, DDM (Roth et al. 2020, ICML, Sec. 4.3; their
`disthist_batchmatch_sampler`): a batch whose histogram of pairwise embedding distances is closest, in the
1-D Wasserstein distance, to the histogram of the b* pool's, so each batch shows the loss the distance
structure of the data rather than a lucky or unlucky slice of it.

The pool is SPC-structured (b*/M classes x M images). As Roth et al., the batch is the best of m random
class-structured batches drawn from the pool (`selection: best_of_m`, m = `candidate_batches`, 10 as theirs);
`selection: greedy` builds it one class group at a time instead (`MatchingBatchSampler`). Their cost also adds
the differences of the embedding mean and std, and passes the two histograms to scipy's `wasserstein_distance`
as samples; here it is the Wasserstein distance between the two distance distributions themselves (histograms
on the pool's bins), the criterion the paper names.
"""

from __future__ import annotations

import numpy as np

from xbn.data.samplers.embedded import MatchingBatchSampler, group_rows, pairwise_distances


def histogram_wasserstein(hists: np.ndarray, target: np.ndarray, bin_width: float) -> np.ndarray:
    """W1 between histograms on the same equal-width bins (rows of `hists`, normalised here, vs `target`):
    bin width times the summed absolute CDF difference. Equals scipy.stats.wasserstein_distance on the bin
    centres weighted by the counts, vectorised over the rows (scipy takes one pair per call)."""
    p = hists / np.maximum(hists.sum(axis=-1, keepdims=True), 1)
    q = target / target.sum()
    return bin_width * np.abs(np.cumsum(p - q, axis=-1)[..., :-1]).sum(axis=-1)


def distance_bins(dist: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray, float]:
    """The bin of every pair of the pool (equal-width bins spanning the pool's distances), the pool's histogram
    (the target) and the bin width."""
    upper = np.triu_indices(len(dist), 1)
    lo, hi = dist[upper].min(), dist[upper].max()
    width = max(hi - lo, 1e-12) / bins
    bin_of = np.clip(((dist - lo) / width).astype(np.int64), 0, bins - 1)
    return bin_of, np.bincount(bin_of[upper], minlength=bins).astype(np.float64), width


def best_distance_match(dist: np.ndarray, group_size: int, candidates: np.ndarray, bins: int = 50) -> int:
    """Which candidate batch ((m, k) group numbers; group g = rows g*group_size.. of the pool's distance
    matrix `dist`) has the pairwise-distance histogram closest to the pool's (Roth et al.'s best of m)."""
    bin_of, target, width = distance_bins(dist, bins)
    rows = group_rows(np.asarray(candidates), group_size)  # (m, n)
    inner = np.triu_indices(rows.shape[1], 1)
    pairs = bin_of[rows[:, :, None], rows[:, None, :]][:, inner[0], inner[1]]  # (m, n(n-1)/2)
    offsets = np.arange(len(rows))[:, None] * bins
    counts = np.bincount((pairs + offsets).ravel(), minlength=len(rows) * bins).reshape(len(rows), bins)
    return int(np.argmin(histogram_wasserstein(counts.astype(np.float64), target, width)))


def greedy_distance_match(dist: np.ndarray, group_size: int, k: int, first: int, bins: int = 50,
                          trials: int = 0, rng: np.random.Generator | None = None) -> list[int]:
    """Groups (consecutive runs of `group_size` rows of the pool's distance matrix `dist`) forming a batch of
    `k` groups whose pairwise-distance histogram is greedily matched to the pool's; starts from `first`.
    `trials` > 0 scores only that many random groups per step (stochastic greedy, drawn from `rng`)."""
    n = len(dist)
    g = n // group_size
    bin_of, target, width = distance_bins(dist, bins)
    rows = np.arange(n).reshape(g, group_size)
    inner = np.triu_indices(group_size, 1)
    own = np.stack([np.bincount(bin_of[np.ix_(r, r)][inner], minlength=bins) for r in rows])  # (g, bins)
    chosen, counts = [first], own[first].astype(np.float64)
    while len(chosen) < min(k, g):
        rest = _candidates(np.setdiff1d(np.arange(g), chosen), trials, rng)
        members = rows[chosen].ravel()
        cross = bin_of[np.ix_(rows[rest].ravel(), members)].reshape(len(rest), -1)  # new pairs with the batch
        offsets = np.arange(len(rest))[:, None] * bins
        cross_counts = np.bincount((cross + offsets).ravel(), minlength=len(rest) * bins).reshape(len(rest), bins)
        candidates = counts + own[rest] + cross_counts
        best = int(np.argmin(histogram_wasserstein(candidates, target, width)))
        chosen.append(int(rest[best]))
        counts = candidates[best]
    return chosen


def _candidates(rest: np.ndarray, trials: int, rng: np.random.Generator | None) -> np.ndarray:
    """The groups a greedy step scores: all of `rest`, or `trials` of them at random (Mirzasoleiman et al.
    2015, "Lazier than lazy greedy": a random subset per step keeps most of the greedy's quality)."""
    if not trials or len(rest) <= trials:
        return rest
    if rng is None:
        raise ValueError("trials > 0 needs an rng")
    return rng.choice(rest, size=trials, replace=False)


class DistanceMatchBatchSampler(MatchingBatchSampler):
    name = "ddm"

    def __init__(self, *args, bins: int = 50, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if bins < 2:
            raise ValueError(f"bins must be >= 2, got {bins}")
        self.bins = bins

    def _greedy(self, features: np.ndarray, first: int, rng: np.random.Generator) -> list[int]:
        return greedy_distance_match(pairwise_distances(features), self.samples_per_class, self.classes_per_batch,
                                     first, self.bins, self.trials, rng)

    def _best(self, features: np.ndarray, candidates: np.ndarray) -> int:
        return best_distance_match(pairwise_distances(features), self.samples_per_class, candidates, self.bins)
