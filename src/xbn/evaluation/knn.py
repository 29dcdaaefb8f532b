"""Exact k-nearest-neighbour search by inner product, chunked over queries.

Embeddings are L2-normalized, so the inner product is the cosine similarity. The search walks the queries one
chunk at a time and keeps only k neighbours per query, so memory stays O(N·k + chunk·N) and never N², which is
what lets a 120k-image test set be evaluated on a laptop.

Leave-one-out on one set (CUB, Cars196, SOP) on the CPU takes a symmetric path: the similarity matrix equals its
transpose, so each block above the diagonal is computed once and serves the top-k of its rows and of its columns.
That halves the O(N²·d) products that dominate the search. Written by hand: faiss and scikit-learn search a set
against itself as against any other set.
"""

from __future__ import annotations

from typing import Any

import faiss
import numpy as np

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
) -> tuple[np.ndarray, np.ndarray]:
    """The k most similar references of each query: (similarities float32 [Nq, k], indices int64 [Nq, k]).

    Rows are sorted by decreasing similarity. `k` is clamped to the number of references (minus one with
    `exclude_self`). `exclude_self=True` is leave-one-out on one set (queries must equal references): k+1
    neighbours are searched and each query's own index is removed by index, not by similarity, so an exact
    duplicate of the query is kept as a neighbour; if duplicates push the query out of its own k+1, the last
    neighbour is dropped instead. `device` "cpu" uses faiss `IndexFlatIP`; a CUDA device uses a faiss GPU
    index when faiss has GPU support, else torch matmul + topk on that device.
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

    if exclude_self and str(device) == "cpu":
        return _self_search(q, k, chunk_size)
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


def _self_search(x: np.ndarray, k: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Leave-one-out k-NN of `x` among its own rows by blocks of the upper triangle of x·xᵀ: block (I, J), J > I,
    updates the running top-k of rows I from its rows and of rows J from its columns. The diagonal blocks go
    first and fill every row's top-k with a plain top-k; after that only entries above a row's current k-th
    best can enter it, and those are few: they are gathered sparsely (`_merge`) instead of a top-k over every
    block, which at k = 100 costs as much as the block's product. The own row is removed by index (the
    diagonal set to -inf), so an exact duplicate of a query stays its neighbour."""
    import torch

    n = len(x)
    xt = torch.from_numpy(x)
    sims = torch.full((n, k), -torch.inf)
    idx = torch.zeros((n, k), dtype=torch.long)
    starts = range(0, n, block)
    with torch.no_grad():
        for i0 in starts:
            i1 = min(i0 + block, n)
            s = xt[i0:i1] @ xt[i0:i1].T
            s.fill_diagonal_(-torch.inf)
            top, at = torch.topk(s, min(k, i1 - i0), dim=1)
            sims[i0:i1, : top.shape[1]], idx[i0:i1, : top.shape[1]] = top, at + i0
        for i0 in starts:
            i1 = min(i0 + block, n)
            for j0 in range(i0 + block, n, block):
                j1 = min(j0 + block, n)
                s = xt[i0:i1] @ xt[j0:j1].T
                r, c = torch.nonzero(s > sims[i0:i1, -1:], as_tuple=True)  # candidates of rows I, by row
                _merge(sims, idx, r + i0, c + j0, s[r, c])
                r, c = torch.nonzero(s > sims[j0:j1, -1], as_tuple=True)  # of rows J (the columns)
                order = torch.argsort(c, stable=True)  # grouped by column, rows ascending within
                r, c = r[order], c[order]
                _merge(sims, idx, c + j0, r + i0, s[r, c])
    return sims.numpy(), idx.numpy()


def _merge(sims, idx, rows, columns, values) -> None:
    """Merge candidates (query `rows` grouped in ascending order, their neighbour `columns` and `values`) into
    the running top-k (sims, idx: descending per row) with one top-k over [touched rows, k + most candidates]."""
    import torch

    if not len(rows):
        return
    k = sims.shape[1]
    touched, counts = torch.unique_consecutive(rows, return_counts=True)
    slot = torch.repeat_interleave(torch.arange(len(touched)), counts)
    position = torch.arange(len(rows)) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    width = k + int(counts.max())
    pool_v = torch.full((len(touched), width), -torch.inf)
    pool_i = torch.zeros((len(touched), width), dtype=torch.long)
    pool_v[:, :k], pool_i[:, :k] = sims[touched], idx[touched]  # the earlier neighbours first: on a tie the
    pool_v[slot, k + position], pool_i[slot, k + position] = values, columns  # lower index stays, as in faiss
    top, at = torch.topk(pool_v, k, dim=1)
    sims[touched], idx[touched] = top, torch.gather(pool_i, 1, at)


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
                index = faiss.index_cpu_to_gpu(resources, dev.index or 0, flat)
                index.add(references)
                # The GPU index points into `resources`: the closure keeps them alive together.
                return lambda chunk, _resources=resources: index.search(chunk, k)
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
