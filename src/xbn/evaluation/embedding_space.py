"""The embedding-space metrics of Roth et al. 2020, "Revisiting Training Strategies and Generalization
Performance in Deep Metric Learning" (ICML), computed at evaluation time.

Of the training embeddings (Sec. 5: how the training data sit in the space predicts generalization):

- `spectral_decay` rho(Phi) = KL(U || S): the KL divergence from the uniform distribution U to the sum-normalized
  singular value spectrum S of the (uncentred) embedding matrix. 0 when every direction carries the same
  energy; larger when a few directions dominate (a compressed space). `skip` leaves the largest values out
  (Roth's `rho_spectrum@<skip+1>`); the metric reports skip = 1 by default, as the paper (footnote 3): the
  first singular value of uncentred embeddings mostly carries their mean direction, not their spread.
- `pi_metrics` embedding space density: pi_intra is the mean over classes of the mean cosine distance between two
  distinct samples of the class; pi_inter the mean cosine distance between two distinct class centres (the
  normalized class means); pi_ratio = pi_intra / pi_inter. Classes with a single sample have no pair and are
  left out of pi_intra (Roth's code gives them the largest class value instead).

Of the evaluated (test) split:

- `clustering_f1`: pair-counting F1 of a faiss k-means clustering (one cluster per label) against the labels.
- `map_at_k`: mean average precision over the k = 1000 nearest neighbours, AP@k = sum_{i<=k} P@i rel_i /
  min(k, R), R the number of relevant references. Roth's code divides by the class size with the query counted,
  so that a perfect ranking scores (n-1)/n there; here it scores 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.stats import entropy
from sklearn.metrics.cluster import pair_confusion_matrix

from xbn.evaluation.knn import _drop_self, _search_fn, as_float32_matrix
from xbn.evaluation.metrics import kmeans_clusters

MAP_K = 1000


def singular_values(embeddings: Any, chunk_size: int = 65536) -> np.ndarray:
    """The singular values of the [N, d] embedding matrix, largest first (min(N, d) of them).

    From the eigenvalues of the d x d Gram matrix accumulated in float64, a chunk of rows at a time, so the
    memory is O(d^2) whatever N is (an SVD of the whole matrix would copy it).
    """
    x = as_float32_matrix(embeddings, "embeddings")
    gram = np.zeros((x.shape[1], x.shape[1]))
    for start in range(0, len(x), chunk_size):
        rows = x[start:start + chunk_size].astype(np.float64)
        gram += rows.T @ rows
    eigenvalues = np.linalg.eigvalsh(gram)[::-1][: min(x.shape)]
    return np.sqrt(np.clip(eigenvalues, 0.0, None))


def spectral_decay(spectrum: np.ndarray, skip: int = 0) -> float:
    """rho = KL(U || S) of a singular value spectrum (`singular_values`), its `skip` largest values left out.

    Values below the float64 round-off of the largest count as that round-off: a rank-deficient spectrum gives
    a large finite rho rather than infinity (which JSON cannot hold).
    """
    s = np.sort(np.asarray(spectrum, dtype=np.float64))[::-1][skip:]
    if len(s) < 2 or s[0] <= 0:
        raise ValueError(f"need at least two positive singular values after skipping {skip}, got {len(s)}")
    s = np.clip(s, s[0] * np.finfo(np.float64).eps, None)
    return float(entropy(np.full(len(s), 1.0 / len(s)), s / s.sum()))


def pi_metrics(embeddings: Any, labels: Any) -> dict[str, float]:
    """pi_intra, pi_inter and pi_ratio (cosine distances, see the module docstring).

    Written by hand (no library has them), in O(N d) without pairwise matrices: for unit vectors in a set of n,
    the sum of cos(x_i, x_j) over i != j is ||sum x_i||^2 - n.
    """
    x = as_float32_matrix(embeddings, "embeddings").astype(np.float64)
    x /= np.clip(np.linalg.norm(x, axis=1, keepdims=True), 1e-12, None)
    _, codes = np.unique(np.asarray(labels), return_inverse=True)
    if len(codes) != len(x):
        raise ValueError(f"labels has {len(codes)} entries but embeddings has {len(x)} rows")
    n_classes = int(codes.max()) + 1
    if n_classes < 2:
        raise ValueError("pi metrics need at least two classes")
    sums = np.zeros((n_classes, x.shape[1]))
    np.add.at(sums, codes, x)
    sizes = np.bincount(codes, minlength=n_classes).astype(np.float64)
    paired = sizes > 1
    if not paired.any():
        raise ValueError("pi_intra needs a class with at least two samples")
    n = sizes[paired]
    mean_cos = ((sums[paired] ** 2).sum(1) - n) / (n * n - n)
    pi_intra = float(np.mean(1.0 - mean_cos))
    centres = sums / np.linalg.norm(sums, axis=1, keepdims=True).clip(1e-12)
    mean_cos_centres = ((centres.sum(0) ** 2).sum() - n_classes) / (n_classes * n_classes - n_classes)
    pi_inter = float(1.0 - mean_cos_centres)
    return {"pi_intra": pi_intra, "pi_inter": pi_inter, "pi_ratio": pi_intra / max(pi_inter, 1e-12)}


def clustering_f1(embeddings: Any, labels: Any, *, seed: int = 0, device: Any = "cpu") -> float:
    """Pair-counting F1 of a faiss k-means clustering (one cluster per distinct label), as Roth's metrics/f1.py:
    2 TP / (2 TP + FP + FN) over the pairs of samples, TP a pair in the same class and the same cluster."""
    codes, assignment = kmeans_clusters(embeddings, labels, seed=seed, device=device)
    (_, fp), (fn, tp) = pair_confusion_matrix(codes, assignment)
    return float(2 * tp / (2 * tp + fp + fn)) if tp else 0.0


def map_at_k(query_emb: Any, query_labels: Any, reference_emb: Any = None, reference_labels: Any = None,
             k: int = MAP_K, *, chunk_size: int = 4096, device: Any = "cpu") -> float:
    """Mean AP over the k nearest references (leave-one-out without references), see the module docstring.

    Queries without any relevant reference are left out (as in `retrieval_metrics`); NaN if none is left.
    """
    leave_one_out = reference_emb is None
    q = as_float32_matrix(query_emb, "query_emb")
    r = q if leave_one_out else as_float32_matrix(reference_emb, "reference_emb")
    q_labels = np.asarray(query_labels)
    r_labels = q_labels if leave_one_out else np.asarray(reference_labels)
    _, codes = np.unique(np.concatenate([q_labels, r_labels]), return_inverse=True)
    q_codes, r_codes = codes[: len(q)], codes[len(q):]
    relevant = np.bincount(r_codes, minlength=codes.max() + 1)[q_codes] - int(leave_one_out)
    k = min(int(k), len(r) - int(leave_one_out))
    if k < 1 or not (relevant > 0).any():
        return float("nan")
    # knn_search's own search and self-removal, one query chunk at a time: O(chunk k) memory, not O(N k).
    search = _search_fn(r, k + int(leave_one_out), device)
    ranks = np.arange(1, k + 1)
    total, count = 0.0, 0
    for start in range(0, len(q), chunk_size):
        rows = np.arange(start, min(start + chunk_size, len(q)))
        sims, idx = search(q[rows])
        if leave_one_out:
            sims, idx = _drop_self(sims, idx, rows)
        keep = relevant[rows] > 0
        hit = r_codes[idx[keep]] == q_codes[rows][keep, None]
        precision_at_hits = np.where(hit, np.cumsum(hit, axis=1) / ranks, 0.0).sum(1)
        total += (precision_at_hits / np.minimum(relevant[rows][keep], k)).sum()
        count += int(keep.sum())
    return float(total / count) if count else float("nan")


def embedding_space_metrics(train_emb: Any, train_labels: Any, query_emb: Any, query_labels: Any,
                            reference_emb: Any = None, reference_labels: Any = None, *, spectrum_skip: int = 1,
                            seed: int = 0, chunk_size: int = 4096,
                            device: Any = "cpu") -> tuple[dict[str, float], np.ndarray]:
    """All of the above: (`rho_spectrum`, `pi_intra`, `pi_inter`, `pi_ratio` of the training embeddings; `f1`
    of the queries; `map@1000` of the queries against the references), and the training spectrum."""
    spectrum = singular_values(train_emb)
    out = {"rho_spectrum": spectral_decay(spectrum, spectrum_skip), **pi_metrics(train_emb, train_labels),
           "f1": clustering_f1(query_emb, query_labels, seed=seed, device=device),
           f"map@{MAP_K}": map_at_k(query_emb, query_labels, reference_emb, reference_labels, MAP_K,
                                    chunk_size=chunk_size, device=device)}
    return out, spectrum


def spectrum_rows(spectrum: np.ndarray) -> list[dict[str, float]]:
    """The spectrum as plot rows: index (1 = largest), singular value, and its share of the sum."""
    total = float(np.sum(spectrum)) or 1.0
    return [{"index": i, "singular_value": float(s), "normalized": float(s) / total}
            for i, s in enumerate(spectrum, start=1)]


__all__ = ["MAP_K", "clustering_f1", "embedding_space_metrics", "map_at_k", "pi_metrics", "singular_values",
           "spectral_decay", "spectrum_rows"]
