"""Exact k-nearest-neighbour search by inner product, chunked over queries.

Embeddings are L2-normalized, so the inner product is the cosine similarity. The search walks the queries one
block at a time and keeps only a few more than k candidates per query, so memory stays O(N·k + block²) and never
N², which is what lets a 120k-image test set be evaluated on a laptop.

On the CPU the search is `xbn.evaluation.cpu_knn`: a bf16 (where this CPU multiplies bf16 fast) or float32
first pass keeps a few more candidates than k, which are re-scored by one exact routine and certified, so the
result does not depend on the path. Leave-one-out on one set (CUB, Cars196, SOP) there takes a symmetric path:
the similarity matrix equals its transpose, so each block above the diagonal is computed once and serves the
top-k of its rows and of its columns, half the O(N²·d) products. On a GPU: faiss's GPU index, or torch.
"""

from __future__ import annotations

from typing import Any

import faiss
import numpy as np

from xbn.evaluation import cpu_knn
from xbn.utils.arrays import finite_array

# faiss GPU indexes refuse larger k (faiss/gpu/utils/DeviceDefs.cuh); beyond it the torch path takes over.
_FAISS_GPU_MAX_K = 2048


def as_float32_matrix(x: Any, name: str) -> np.ndarray:
    """A contiguous float32 [N, d] numpy view or copy of a numpy array or torch tensor (what faiss needs)."""
    return finite_array(x, name, 2, "a 2-D [N, d] array")


def as_exclude(exclude: Any, num_queries: int) -> np.ndarray:
    """`exclude` (one reference index per query, left out of that query's search) as an int64 array."""
    exclude = np.asarray(exclude, dtype=np.int64)
    if exclude.shape != (num_queries,):
        raise ValueError(f"exclude must hold one reference index per query, got shape {exclude.shape}")
    return exclude


def knn_search(
    queries: Any,
    references: Any,
    k: int,
    *,
    exclude_self: bool = False,
    chunk_size: int = 4096,
    device: Any = "cpu",
    exclude: Any = None,
    stats: dict | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The k most similar references of each query: (similarities float32 [Nq, k], indices int64 [Nq, k]).

    Rows are sorted by decreasing similarity. `k` is clamped to the number of references (minus one with
    `exclude_self`). `exclude_self=True` is leave-one-out on one set (queries must equal references): k+1
    neighbours are searched and each query's own index is removed by index, not by similarity, so an exact
    duplicate of the query is kept as a neighbour. `device` "cpu" is exact with ties broken by the lower index
    (`cpu_knn`; `stats`, a dict, receives its path and fallback counts); a CUDA device uses a faiss GPU index
    when faiss has GPU support, else torch matmul + topk on that device (there, if duplicates push the query out
    of its own k+1, the last neighbour is dropped instead).
    `exclude` (int array [Nq]) drops reference `exclude[i]` from query i's list the same way: leave-one-out
    when the queries are transformed copies of the references (refined queries against the plain set).
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    same_object = references is queries
    q = as_float32_matrix(queries, "queries")
    r = q if same_object else as_float32_matrix(references, "references")
    if q.shape[1] != r.shape[1]:
        raise ValueError(f"queries have dimension {q.shape[1]} but references have {r.shape[1]}")
    if len(r) == 0:
        raise ValueError("references is empty")
    # Leave-one-out on two different sets would silently drop the wrong rows; the check is O(N·d), cheap
    # next to the O(N²·d) search.
    if exclude_self and not same_object and not np.array_equal(q, r):
        raise ValueError("exclude_self=True is leave-one-out: queries and references must be the same set")

    if exclude is not None:
        if exclude_self:
            raise ValueError("pass exclude_self or exclude, not both")
        exclude = as_exclude(exclude, len(q))
    drop = exclude_self or exclude is not None
    k = min(int(k), len(r) - int(drop))
    sims = np.empty((len(q), k), dtype=np.float32)
    idx = np.empty((len(q), k), dtype=np.int64)
    if k == 0:  # leave-one-out on a single embedding: there is no neighbour to return
        return sims, idx
    k_search = k + int(drop)

    if str(device) == "cpu":
        return cpu_knn.search(q, r, k, exclude=exclude, symmetric=exclude_self, block=chunk_size, stats=stats)
    search = _search_fn(r, k_search, device)
    for start in range(0, len(q), chunk_size):
        stop = min(start + chunk_size, len(q))
        d_chunk, i_chunk = search(q[start:stop])
        if drop:
            own = np.arange(start, stop) if exclude is None else exclude[start:stop]
            d_chunk, i_chunk = _drop_self(d_chunk, i_chunk, own)
        sims[start:stop] = d_chunk
        idx[start:stop] = i_chunk
    return sims, idx


def _drop_self(sims: np.ndarray, idx: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Remove each row's own index from its k+1 neighbours, leaving k."""
    drop = idx == rows[:, None]
    # With more exact duplicates than k+1 a query may miss its own list; it then loses its last neighbour.
    drop[~drop.any(axis=1), -1] = True
    n, k_plus_one = idx.shape
    keep = ~drop
    return sims[keep].reshape(n, k_plus_one - 1), idx[keep].reshape(n, k_plus_one - 1)


def _search_fn(references: np.ndarray, k: int, device: Any):
    """A function mapping a query chunk to (similarities, indices), searched on the requested device."""
    if str(device) != "cpu":
        import torch

        dev = torch.device(device)
        if dev.type == "cuda":
            if hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0 and k <= _FAISS_GPU_MAX_K:
                resources = faiss.StandardGpuResources()
                flat = faiss.IndexFlatIP(references.shape[1])
                on_gpu = faiss.index_cpu_to_gpu(resources, dev.index or 0, flat)
                on_gpu.add(references)
                # The GPU index points into `resources`: the closure keeps them alive together.
                return lambda chunk, _resources=resources: on_gpu.search(chunk, k)
            return _torch_search_fn(references, k, dev)
        if dev.type != "cpu":  # e.g. mps: no faiss there
            return _torch_search_fn(references, k, dev)
    index = faiss.IndexFlatIP(references.shape[1])
    index.add(references)
    return lambda chunk: index.search(chunk, k)


def _torch_search_fn(references: np.ndarray, k: int, device: Any):
    """Exact search by matmul + topk with torch on `device` (the GPU path when faiss has no GPU support)."""
    import torch

    ref = torch.from_numpy(references).to(device)

    @torch.no_grad()
    def search(chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        values, indices = torch.topk(torch.from_numpy(chunk).to(device) @ ref.T, k, dim=1)
        return values.cpu().numpy(), indices.cpu().numpy()

    return search
