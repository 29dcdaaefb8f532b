"""Exact re-ranking of an on-disk IVF-PQ's candidates from vectors memory-mapped, not loaded.

An on-disk IVF-PQ (`xbn.serving.shards`) keeps its catalogue's vectors beside the index as one `.npy` file
(`REFINE_FILE`, fp16 by default: 1 KB a 512-d row, 10 GB for 10M rows), written shard by shard and opened
with `mmap`, so a search reads only its candidates' rows. faiss's own `IndexRefine` cannot do this here: its
refine store is read into memory with the index, and faiss 1.15 refuses `IO_FLAG_MMAP_IFC` together with the
`IO_FLAG_ONDISK_SAME_DIR` that the on-disk lists need. So `MappedRefine` does what `IndexRefine` does by hand:
the PQ search returns k x k_factor candidates, re-ranked by their exact inner product with the query.

A mapped page the search touched stays in the process's resident set until the mapping is told otherwise, and
a fault maps more than its row: ext4 keeps a cached file in folios of up to 2 MB and the kernel maps a whole
folio at once (640 random rows of a cached 1 GB store mapped 0.56 GB; 20 000 rows, all of it; measured, Linux
6.18, with or without MADV_RANDOM / MADV_NOHUGEPAGE). So a server's RSS would grow towards the file's size.
The candidates are read `GATHER_ROWS` at a time and the mapping released after each block (`MADV_DONTNEED`,
0.02 ms): the pages stay in the kernel's page cache, shared and reclaimable, the next read maps them again,
and a search holds at most `GATHER_ROWS` folios mapped (128 MB) however many candidates it re-ranks.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from pathlib import Path

import faiss
import numpy as np

from xbn.utils.io import atomic_path

REFINE_FILE = "refine.npy"
STORE_DTYPES = {"fp16": np.float16, "flat": np.float32}  # index.refine -> the store's element type
GATHER_ROWS = 64  # candidates read between two releases of the mapping (no slower than one gather, measured)


class StoreMismatch(ValueError):
    """A refine store that does not match its index (rows, dimension, type) or is truncated."""


def write_store(chunks: Iterable[np.ndarray], path: str | Path, rows: int, dim: int, store: str = "fp16") -> Path:
    """Write the row blocks `chunks` (float32 [n_i, dim], in row order, one at a time in memory) as one `.npy`
    of `rows` x `dim` in `store`'s type, atomically: a failure or a row count other than `rows` leaves no file."""
    dtype = np.dtype(STORE_DTYPES[store])
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        np.lib.format.write_array_header_1_0(
            fh, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (rows, dim)})
        written = 0
        for block in chunks:
            if block.ndim != 2 or block.shape[1] != dim:
                raise StoreMismatch(f"{path}: a block of shape {block.shape}, expected rows of {dim}")
            fh.write(np.ascontiguousarray(block, dtype=dtype).tobytes())
            written += len(block)
        if written != rows:
            raise StoreMismatch(f"{path}: {written} rows written, {rows} announced")
    return path


def open_store(path: str | Path, rows: int, dim: int) -> np.ndarray:
    """The store at `path` as a read-only array over a memory map of the file (nothing is read until a row is
    used); refuses a file whose header or size does not hold `rows` x `dim`, naming it."""
    path = Path(path)
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed by the `with` below; opened alone to name a missing file
    except FileNotFoundError:
        raise StoreMismatch(f"{path}: the index's refine store is missing: rebuild the index") from None
    with fh:
        try:
            version = np.lib.format.read_magic(fh)
            reader = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
            shape, fortran, dtype = reader[version](fh)
        except (ValueError, KeyError) as exc:
            raise StoreMismatch(f"{path}: not a .npy refine store ({exc})") from None
        offset = fh.tell()
        if shape != (rows, dim) or fortran or dtype not in map(np.dtype, STORE_DTYPES.values()):
            raise StoreMismatch(f"{path}: holds {shape} {dtype}, the index {rows} x {dim} rows: rebuild the index")
        size = os.fstat(fh.fileno()).st_size
        if size != offset + rows * dim * dtype.itemsize:
            raise StoreMismatch(f"{path}: {size} bytes, {offset + rows * dim * dtype.itemsize} expected for "
                                f"{rows} x {dim} {dtype} (truncated?): rebuild the index")
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)  # the map outlives the file handle
    return np.ndarray((rows, dim), dtype, buffer=mapped, offset=offset)


class MappedRefine:
    """An IVF-PQ `base` whose k x `k_factor` candidates are re-ranked by the exact inner product with the rows
    of `vectors` (a memory-mapped store, row i = the base's id i). Searches like a faiss index: `search(q, k)`,
    `ntotal`, `d`; `set_search_params` sets its `k_factor` and its base's nprobe."""

    def __init__(self, base: faiss.Index, vectors: np.ndarray, k_factor: int = 1) -> None:
        if vectors.shape != (base.ntotal, base.d):
            raise StoreMismatch(f"the refine store holds {vectors.shape}, the index {base.ntotal} x {base.d}")
        self.base_index, self.vectors, self.k_factor = base, vectors, int(k_factor)

    @property
    def ntotal(self) -> int:
        return int(self.base_index.ntotal)

    @property
    def d(self) -> int:
        return int(self.base_index.d)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores float32 [nq, k], ids int64 [nq, k]) best first; -1 where fewer than k candidates came."""
        _, candidates = self.base_index.search(queries, min(k * self.k_factor, self.ntotal))
        return self.rerank(queries, candidates, k)

    def rerank(self, queries: np.ndarray, candidates: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The top `k` of each query's `candidates` (ids, -1 = none) by the exact inner product."""
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        ids = np.full((len(queries), k), -1, dtype=np.int64)
        for i, (query, found) in enumerate(zip(queries, candidates)):
            found = np.unique(found[found >= 0])  # sorted: the rows are read in file order
            exact = np.empty(len(found), dtype=np.float32)
            for start in range(0, len(found), GATHER_ROWS):
                try:
                    block = self.vectors[found[start : start + GATHER_ROWS]]
                    exact[start : start + len(block)] = block.astype(np.float32) @ query
                finally:
                    self.release()
            best = np.argsort(-exact, kind="stable")[:k]
            scores[i, : len(best)], ids[i, : len(best)] = exact[best], found[best]
        return scores, ids

    def release(self) -> None:
        """Unmap the pages the last reads touched (they stay in the page cache; see the module docstring)."""
        mapped = self.vectors.base
        if isinstance(mapped, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED)
