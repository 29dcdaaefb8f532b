"""Retrieval metrics of deep metric learning: Recall@k, MAP@R, R-precision and NMI.

Two protocols: leave-one-out on one set (CUB-200, Cars196, SOP: every image queries all the others) and query
→ gallery (In-Shop, DeepFashion2). MAP@R and R-precision follow Musgrave et al., "A Metric Learning Reality
Check" (ECCV 2020), and equal pytorch-metric-learning's `AccuracyCalculator`; Recall@k is the DML meaning, "at
least one of the k nearest neighbours shares the query's label", not precision.

One chunked kNN search feeds every kNN metric, so memory is O(N·k + chunk·N), never N².
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import faiss
import numpy as np

from xbn.evaluation.knn import as_exclude, as_float32_matrix, knn_search

# k-means iterations for NMI: pytorch-metric-learning's choice, so that NMI values are comparable with it.
KMEANS_NITER = 20


@dataclass(frozen=True)
class QueryScores:
    """The per-query values behind `retrieval_metrics`'s kNN metrics (`per_query=True`), for paired tests.

    `evaluated` (bool [Nq]) marks the queries with at least one match, the ones every kNN metric averages
    over; `scores[name]` (float64, one value per evaluated query, in query order) holds `recall@k` hits (1.0 /
    0.0), `map@r` (AP@R) and `r_precision`, so that `scores[name].mean() == metrics[name]`.
    """

    evaluated: np.ndarray
    scores: dict[str, np.ndarray]


# per_query picks the return type: the metrics, or the metrics and the per-query values.
@overload
def retrieval_metrics(
    query_emb: Any, query_labels: Any, reference_emb: Any = ..., reference_labels: Any = ...,
    ks: Sequence[int] = ..., chunk_size: int = ..., device: Any = ..., nmi: bool = ..., seed: int = ...,
    exclude: Any = ..., per_query: Literal[False] = ...,
) -> dict[str, float]: ...


@overload
def retrieval_metrics(
    query_emb: Any, query_labels: Any, reference_emb: Any = ..., reference_labels: Any = ...,
    ks: Sequence[int] = ..., chunk_size: int = ..., device: Any = ..., nmi: bool = ..., seed: int = ...,
    exclude: Any = ..., *, per_query: Literal[True],
) -> tuple[dict[str, float], QueryScores]: ...


def retrieval_metrics(
    query_emb: Any,
    query_labels: Any,
    reference_emb: Any = None,
    reference_labels: Any = None,
    ks: Sequence[int] = (1, 2, 4, 8, 10, 100),
    chunk_size: int = 4096,
    device: Any = "cpu",
    nmi: bool = True,
    seed: int = 0,
    exclude: Any = None,
    per_query: bool = False,
) -> dict[str, float] | tuple[dict[str, float], QueryScores]:
    """Recall@k for each k in `ks`, MAP@R, R-precision and NMI of L2-normalized embeddings.

    Without references, each query is searched among the other queries (leave-one-out); with them, among the
    references. R is the number of references sharing the query's label (the query itself excluded).
    Queries with R = 0 (a label seen once in leave-one-out, or absent from the gallery) have no correct
    answer: they are left out of every kNN metric, as in pytorch-metric-learning, and counted in
    `queries_without_match`; if no query is left, the kNN metrics are NaN. NMI clusters all query embeddings
    (faiss k-means, one cluster per distinct query label, `seed` fixed); `nmi=False` skips it and leaves the
    key out. Returns `recall@{k}`..., `map@r`, `r_precision`, `nmi`, `num_queries` (all queries given),
    `num_references` and `queries_without_match`. `exclude` (with references; int array [Nq]) leaves
    reference `exclude[i]` out of query i's search and of its R: leave-one-out when query i is a transformed
    copy of reference i (a refined query against the plain set). `per_query=True` returns
    `(metrics, QueryScores)`: the same search's per-query values, for a paired comparison of two models.
    """
    ks = _check_ks(ks)
    leave_one_out = reference_emb is None
    if leave_one_out != (reference_labels is None):
        raise ValueError("pass both reference_emb and reference_labels, or neither (leave-one-out)")
    queries = as_float32_matrix(query_emb, "query_emb")
    q_labels = _as_labels(query_labels, len(queries), "query_labels", "query_emb")
    if leave_one_out:
        references, r_labels = queries, q_labels
    else:
        references = as_float32_matrix(reference_emb, "reference_emb")
        r_labels = _as_labels(reference_labels, len(references), "reference_labels", "reference_emb")
        if references.shape[1] != queries.shape[1]:
            raise ValueError(
                f"reference_emb has dimension {references.shape[1]} but query_emb has {queries.shape[1]}"
            )
    if len(queries) == 0 or len(references) == 0:
        raise ValueError("query_emb and reference_emb must not be empty")

    # Labels of any type (ints, strings) become codes over the union of both sets.
    _, codes = np.unique(np.concatenate([q_labels, r_labels]), return_inverse=True)
    q_codes, r_codes = codes[: len(q_labels)], codes[len(q_labels) :]
    num_relevant = np.bincount(r_codes, minlength=codes.max() + 1)[q_codes] - int(leave_one_out)
    if exclude is not None:
        if leave_one_out:
            raise ValueError("exclude needs reference_emb (without it the search is leave-one-out already)")
        exclude = as_exclude(exclude, len(queries))
        num_relevant = num_relevant - (r_codes[exclude] == q_codes)
    has_match = num_relevant > 0

    out: dict[str, float] = {}
    names = [*(f"recall@{k}" for k in ks), "map@r", "r_precision"]
    scores = {name: np.empty(0) for name in names}
    if has_match.any():
        k = max(max(ks), int(num_relevant.max()))
        _, idx = knn_search(
            queries, references, k, exclude_self=leave_one_out, chunk_size=chunk_size, device=device,
            exclude=exclude,
        )
        metrics, scores = _knn_metrics(idx, q_codes, r_codes, num_relevant, ks, chunk_size)
        out.update(metrics)
    else:
        out.update(dict.fromkeys(names, float("nan")))
    if nmi:
        out["nmi"] = nmi_score(queries, q_labels, seed=seed, device=device)
    out["num_queries"] = len(queries)
    out["num_references"] = len(references)
    out["queries_without_match"] = int((~has_match).sum())
    if per_query:
        return out, QueryScores(evaluated=has_match, scores=scores)
    return out


def _knn_metrics(
    idx: np.ndarray,
    q_codes: np.ndarray,
    r_codes: np.ndarray,
    num_relevant: np.ndarray,
    ks: list[int],
    chunk_size: int,
) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Average the per-query metrics over queries that have a match, a chunk of rows at a time; also return
    the per-query values (one float per evaluated query, see `QueryScores`)."""
    ranks = np.arange(1, idx.shape[1] + 1)
    recall_hits = np.zeros(len(ks), dtype=np.int64)
    ap_sum = rp_sum = 0.0
    num_evaluated = 0
    per_query: dict[str, list[np.ndarray]] = {name: [] for name in (*(f"recall@{k}" for k in ks), "map@r",
                                                                    "r_precision")}
    for start in range(0, len(idx), chunk_size):
        rows = slice(start, start + chunk_size)
        keep = num_relevant[rows] > 0
        r = num_relevant[rows][keep]
        hit = r_codes[idx[rows][keep]] == q_codes[rows][keep, None]  # [c, k]: neighbour shares the label
        for i, k in enumerate(ks):
            found = hit[:, :k].any(axis=1)
            recall_hits[i] += found.sum()
            per_query[f"recall@{k}"].append(found.astype(np.float64))
        # MAP@R: mean over the first R ranks of precision@i at each correct rank i, divided by R.
        relevant = hit & (ranks <= r[:, None])
        correct_so_far = np.cumsum(relevant, axis=1)
        ap = np.where(relevant, correct_so_far / ranks, 0.0).sum(axis=1) / r
        rp = correct_so_far[:, -1] / r
        ap_sum += ap.sum()
        rp_sum += rp.sum()
        per_query["map@r"].append(ap)
        per_query["r_precision"].append(rp)
        num_evaluated += len(r)
    out = {f"recall@{k}": float(hits / num_evaluated) for k, hits in zip(ks, recall_hits)}
    out["map@r"] = float(ap_sum / num_evaluated)
    out["r_precision"] = float(rp_sum / num_evaluated)
    return out, {name: np.concatenate(values) for name, values in per_query.items()}


def nmi_score(embeddings: Any, labels: Any, *, seed: int = 0, device: Any = "cpu") -> float:
    """NMI between the labels and a faiss k-means clustering (one cluster per distinct label)."""
    from sklearn.metrics import normalized_mutual_info_score

    codes, assignment = kmeans_clusters(embeddings, labels, seed=seed, device=device)
    return float(normalized_mutual_info_score(codes, assignment))


def kmeans_clusters(embeddings: Any, labels: Any, *, seed: int = 0, device: Any = "cpu"
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(label codes, cluster of each embedding) of a faiss k-means with one cluster per distinct label, the
    clustering that NMI and the clustering F1 score."""
    x = as_float32_matrix(embeddings, "embeddings")
    _, codes = np.unique(_as_labels(labels, len(x), "labels", "embeddings"), return_inverse=True)
    use_gpu = str(device).startswith("cuda") and hasattr(faiss, "StandardGpuResources")
    use_gpu = use_gpu and faiss.get_num_gpus() > 0
    # min_points_per_centroid=1 only silences faiss's "provide at least 39 points per centroid" warning:
    # DML test sets have ~5 images per class by design.
    n_clusters = int(codes.max()) + 1
    kmeans = faiss.Kmeans(
        x.shape[1], n_clusters, niter=KMEANS_NITER, seed=seed, gpu=use_gpu, min_points_per_centroid=1
    )
    kmeans.train(x)
    _, assignment = kmeans.index.search(x, 1)
    return codes, assignment.ravel()


def _check_ks(ks: Sequence[int]) -> list[int]:
    ks = list(dict.fromkeys(ks))  # unique, in the caller's order
    if not ks or any(isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1 for k in ks):
        raise ValueError(f"ks must be a non-empty sequence of positive integers, got {ks!r}")
    return [int(k) for k in ks]


def _as_labels(labels: Any, n: int, name: str, emb_name: str) -> np.ndarray:
    if hasattr(labels, "detach"):
        labels = labels.detach().cpu().numpy()
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one label per embedding), got shape {labels.shape}")
    if len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} entries but {emb_name} has {n} rows")
    return labels
