"""Frechet-distance batches, FRD (Roth et al. 2020, ICML, Sec. 4.3; their `fid_batchmatch_sampler`): a batch
whose Gaussian fit (mean, covariance of its embeddings) is closest in the Frechet distance to the fit of the
b* pool, so each batch is a small but faithful summary of the embedding distribution.

    FD = |mu_p - mu_b|^2 + tr(S_p) + tr(S_b) - 2 tr((S_p S_b)^(1/2))

As for DDM, the pool is SPC-structured and the batch is the best of m random class-structured batches from it
(`selection: best_of_m`, Roth et al.'s procedure) or is built greedily, one class group at a time
(`selection: greedy`; `MatchingBatchSampler`). A batch of n < d images has a covariance of rank < n, so
tr((S_p S_b)^(1/2)) is the sum of square roots of the eigenvalues of the n x n matrix Y S_p Y^T / (n-1), Y the
centred batch (S_p Y^T Y and Y S_p Y^T share their non-zero eigenvalues): no d x d matrix square root (their
`scipy.linalg.sqrtm`), and every candidate group of a greedy step is scored in one batched `eigvalsh`.
"""

from __future__ import annotations

import numpy as np

from xbn.data.samplers.ddm import _candidates
from xbn.data.samplers.embedded import MatchingBatchSampler, group_rows


def pool_statistics(pool: np.ndarray) -> dict[str, np.ndarray]:
    """What the Frechet distance of any subset of `pool` (N x d) to the whole needs, computed once per pool:
    mu_p, tr(S_p) and K = x_i^T S_p x_j for all pairs (covariances with N-1, as numpy's `cov`)."""
    mu = pool.mean(axis=0)
    centred = pool - mu
    if pool.shape[1] <= len(pool):  # through the d x d covariance: N d^2 + N^2 d
        k = pool @ (centred.T @ centred) @ pool.T
    else:  # through the N x N cross products: 2 N^2 d + N^3
        a = pool @ centred.T
        k = a @ a.T
    return {"pool": pool, "mu": mu, "k": k / (len(pool) - 1),
            "trace": np.einsum("ij,ij->", centred, centred) / (len(pool) - 1)}


def frechet_from_statistics(stats: dict[str, np.ndarray], subsets: np.ndarray) -> np.ndarray:
    """Frechet distance between the pool's Gaussian fit and that of each row subset (C x n row numbers)."""
    n = subsets.shape[1]
    denom = max(n - 1, 1)
    x = stats["pool"][subsets]  # (C, n, d)
    mu = x.mean(axis=1)
    mean_term = ((mu - stats["mu"]) ** 2).sum(axis=-1)
    trace_sub = ((x - mu[:, None]) ** 2).sum(axis=(1, 2)) / denom
    h = np.eye(n) - 1.0 / n  # centring matrix: H K[S, S] H = Y S_p Y^T
    k_s = h @ stats["k"][subsets[:, :, None], subsets[:, None, :]] @ h
    trace_sqrt = np.sqrt(np.clip(_batched_eigvalsh(k_s / denom), 0.0, None)).sum(axis=-1)
    return np.maximum(mean_term + stats["trace"] + trace_sub - 2 * trace_sqrt, 0.0)


def _batched_eigvalsh(matrices: np.ndarray) -> np.ndarray:
    # torch's batched solver: numpy's stacked eigvalsh took about 10x longer on (255, 64, 64) here.
    import torch

    return torch.linalg.eigvalsh(torch.from_numpy(np.ascontiguousarray(matrices))).numpy()


def frechet_distance_to_pool(pool: np.ndarray, subsets: np.ndarray) -> np.ndarray:
    """Frechet distance between the Gaussian fit of `pool` (N x d) and that of each row subset in `subsets`."""
    return frechet_from_statistics(pool_statistics(pool), subsets)


def greedy_frechet_match(pool: np.ndarray, group_size: int, k: int, first: int, trials: int = 0,
                         rng: np.random.Generator | None = None) -> list[int]:
    """Groups (consecutive runs of `group_size` rows of `pool`) forming a batch of `k` groups whose Gaussian
    fit is greedily matched to the pool's in the Frechet distance; starts from group `first`. `trials` > 0
    scores only that many random groups per step (stochastic greedy, drawn from `rng`)."""
    g = len(pool) // group_size
    rows = np.arange(g * group_size).reshape(g, group_size)
    stats = pool_statistics(pool)
    chosen = [first]
    while len(chosen) < min(k, g):
        rest = _candidates(np.setdiff1d(np.arange(g), chosen), trials, rng)
        members = rows[chosen].ravel()
        subsets = np.concatenate([np.broadcast_to(members, (len(rest), len(members))), rows[rest]], axis=1)
        chosen.append(int(rest[np.argmin(frechet_from_statistics(stats, subsets))]))
    return chosen


def best_frechet_match(pool: np.ndarray, group_size: int, candidates: np.ndarray) -> int:
    """Which candidate batch ((m, k) group numbers; group g = rows g*group_size.. of `pool`) has the Gaussian
    fit closest to the pool's in the Frechet distance (Roth et al.'s best of m)."""
    return int(np.argmin(frechet_distance_to_pool(pool, group_rows(np.asarray(candidates), group_size))))


class FrechetMatchBatchSampler(MatchingBatchSampler):
    name = "frd"

    def _greedy(self, features: np.ndarray, first: int, rng: np.random.Generator) -> list[int]:
        return greedy_frechet_match(features, self.samples_per_class, self.classes_per_batch, first, self.trials,
                                    rng)

    def _best(self, features: np.ndarray, candidates: np.ndarray) -> int:
        return best_frechet_match(features, self.samples_per_class, candidates)
