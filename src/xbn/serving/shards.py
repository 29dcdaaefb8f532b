"""A catalogue larger than one machine's memory: faiss's own on-disk IVF, built from embedding shards.

The path is faiss's (`faiss/contrib/ondisk.py`, the "indexing 1G vectors" recipe): every shard is one parquet
file of `xbn embed` (each machine embeds its part of the catalogue), then

1. `train_ivf`: an empty IVF index (IVF-Flat or IVF-PQ) trained on a sample drawn from all the shards;
2. `fill_shard`: each shard's rows added to a copy of it, with their global row numbers as ids (a shard at a
   time, so memory holds one shard; this step can run on the machine that embedded the shard);
3. `merge_ondisk`: the shards' inverted lists merged into one `index.ivfdata` file that faiss memory-maps, so a
   search reads only the lists it probes, not the catalogue.

`build_sharded` runs the three steps and writes an ordinary index folder (`xbn.serving.index`: index.faiss,
ids.parquet, index.json) plus `index.ivfdata`, so `CatalogueIndex.load`, `xbn search`, `xbn serve` and the
registry's `index/` artifact take it as they take any other; faiss reads the `.ivfdata` from the folder the
index file is in (`IO_FLAG_ONDISK_SAME_DIR`), so the folder can be moved or downloaded. Its recall@10 is
measured against exact search streamed over the shards.

An on-disk IVF-PQ is re-ranked exactly as the in-memory one is (`index.refine`, `xbn.serving.index`), its
k_factor tuned against the same streamed exact search, but from a store that is memory-mapped, not loaded:
the shards' vectors are written one shard at a time to `refine.npy` beside the index (fp16: 1 KB a 512-d row,
10 GB for 10M rows), and `xbn.serving.mapped_refine.MappedRefine` re-ranks the PQ candidates from it (faiss's
IndexRefine would read its store into memory). So neither the lists nor the vectors are in RAM when serving.
The build records each phase's seconds in index.json (`build_s`).
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import faiss
import numpy as np
import pandas as pd
from faiss.contrib.ondisk import merge_ondisk

from xbn.config import IndexConfig
from xbn.data.errors import DatasetError
from xbn.evaluation.knn import knn_search
from xbn.serving.embed_job import read_embeddings
from xbn.serving.index import (
    FORMAT,
    IDS_FILE,
    INDEX_FILE,
    META_FILE,
    RECALL_K,
    TIE_SLACK,
    CatalogueIndex,
    GroundTruth,
    _id_map,
    ivf_spec,
    recall_on,
    sample_rows,
    set_search_params,
    tune_k_factor,
    unit_rows,
)
from xbn.serving.mapped_refine import REFINE_FILE, MappedRefine, open_store, write_store
from xbn.utils.faults import fault_point
from xbn.utils.io import atomic_folder, atomic_path, file_digest, write_json

log = logging.getLogger(__name__)

IVFDATA_FILE = "index.ivfdata"
ONDISK_TYPES = ("ivf_flat", "ivf_pq")  # HNSW and flat have no inverted lists to put on disk
TRAIN_POINTS_PER_CELL = 64  # training sample: nlist x this many rows at most (faiss asks for 39 at least)


def _rows(shards: Sequence[Path]) -> list[int]:
    import pyarrow.parquet as pq

    return [pq.ParquetFile(s).metadata.num_rows for s in shards]


def train_ivf(shards: Sequence[Path], cfg: IndexConfig, dim: int, total: int) -> tuple[faiss.Index, dict]:
    """An empty inner-product IVF index of type `cfg.type`, trained on a sample spread over all `shards` in
    proportion to their sizes, and its parameters."""
    if cfg.type not in ONDISK_TYPES:
        raise ValueError(f"an on-disk index is IVF: index.type must be one of {ONDISK_TYPES}, not {cfg.type}")
    spec, params = ivf_spec(cfg, cfg.type, total, dim)
    nlist = params["nlist"]
    want = min(total, nlist * TRAIN_POINTS_PER_CELL)
    rng = np.random.default_rng(cfg.seed)
    sample = []
    for shard, n in zip(shards, _rows(shards)):
        _, emb = read_embeddings(shard)
        take = min(n, math.ceil(want * n / total))
        sample.append(unit_rows(emb[np.sort(rng.choice(n, take, replace=False))], "embeddings"))
    index = faiss.index_factory(dim, spec, faiss.METRIC_INNER_PRODUCT)
    index.train(np.concatenate(sample))
    return index, params


def fill_shard(trained: str | Path, shard: str | Path, first_row: int, output: str | Path) -> int:
    """Add the rows of the embedding file `shard` to a copy of the trained index at `trained`, with ids
    `first_row`, `first_row + 1`, ..., and write it to `output`; returns the number of rows."""
    index = faiss.read_index(str(trained))
    _, emb = read_embeddings(shard)
    index.add_with_ids(unit_rows(emb, "embeddings"), np.arange(first_row, first_row + len(emb), dtype=np.int64))
    with atomic_path(output) as tmp:
        faiss.write_index(index, str(tmp))
    return len(emb)


def build_sharded(
    shards: Sequence[str | Path], directory: str | Path, cfg: IndexConfig, model_sha256: str = "",
    recall_queries: int | None = None,
) -> CatalogueIndex:
    """An on-disk IVF index folder at `directory` over the embedding files `shards` (outputs of `xbn embed`,
    one per part of the catalogue; row order: the shards' in turn). The shards must come from one model. Built
    in a new folder that then replaces `directory` whole (`atomic_folder`): two builders never mix their files.
    The returned index maps files that moved with their folder (open maps follow the files, not the names)."""
    with atomic_folder(directory) as building:
        catalogue = _build_sharded_in(shards, building, cfg, model_sha256, recall_queries)
        fault_point("index.before_swap")
    log.info("index: on-disk %s over %d x %d from %d shard(s), recall@%d %.4f -> %s", cfg.type, catalogue.count,
             catalogue.dim, len(shards), RECALL_K, catalogue.meta[f"recall@{RECALL_K}"], directory)
    return catalogue


def _build_sharded_in(shards: Sequence[str | Path], directory: Path, cfg: IndexConfig, model_sha256: str,
                      recall_queries: int | None) -> CatalogueIndex:
    paths = [Path(s) for s in shards]
    if not paths:
        raise ValueError("no embedding shards to index")
    frames = [_id_columns(s) for s in paths]  # the id maps: paths and labels, no embeddings
    counts = [len(f) for f in frames]
    total, dim = sum(counts), _dim(paths[0])
    work = directory / ".shards"  # inside the new folder: each builder has its own
    work.mkdir()
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal clock
        seconds[name] = round(time.perf_counter() - clock, 1)
        clock = time.perf_counter()
        log.info("index: %s done in %.1f s", name, seconds[name])

    trained, params = train_ivf(paths, cfg, dim, total)
    faiss.write_index(trained, str(work / "trained.index"))
    phase("train")
    parts, first = [], 0
    for i, (shard, n) in enumerate(zip(paths, counts)):
        parts.append(str(work / f"shard-{i:04d}.index"))
        fill_shard(work / "trained.index", shard, first, parts[-1])
        first += n
    phase("fill")
    # merge_ondisk writes the lists into the .ivfdata as it merges: it is built in the work folder and moved
    # in with the index file (which names it; IO_FLAG_ONDISK_SAME_DIR finds it beside the index on load).
    merged = faiss.read_index(str(work / "trained.index"))
    merge_ondisk(merged, parts, str(work / IVFDATA_FILE))
    faiss.write_index(merged, str(work / INDEX_FILE))
    del merged
    for part in parts:  # the shards' own copies of the lists: as large as the .ivfdata
        Path(part).unlink()
    phase("merge")
    files = [IVFDATA_FILE, INDEX_FILE]
    refined = cfg.type == "ivf_pq" and cfg.refine != "none"
    if refined:  # the exact vectors, in row order, one shard in memory at a time
        write_store((unit_rows(read_embeddings(s)[1], "embeddings") for s in paths), work / REFINE_FILE,
                    total, dim, cfg.refine)
        files.append(REFINE_FILE)
        params.update(refine=cfg.refine, k_factor=1)
        phase("refine_store")
    for name in files:
        (work / name).replace(directory / name)
    ids = _id_map(pd.concat(frames, ignore_index=True), 0)
    del frames
    with atomic_path(directory / IDS_FILE) as tmp:
        ids.to_parquet(tmp, index=False)
    shutil.rmtree(work, ignore_errors=True)
    phase("ids")

    ondisk = faiss.read_index(str(directory / INDEX_FILE), faiss.IO_FLAG_ONDISK_SAME_DIR)
    index = MappedRefine(ondisk, open_store(directory / REFINE_FILE, total, dim)) if refined else ondisk
    set_search_params(index, params)
    sample = recall_queries or cfg.recall_queries
    check = sample_rows(total, sample, cfg.seed)
    tune = sample_rows(total, sample, cfg.seed + 1, avoid=check) if "k_factor" in params else check[:0]
    truth = streamed_truth(paths, np.union1d(check, tune))  # one pass over the shards for both query sets
    phase("exact_truth")
    tuning = None
    if len(tune):  # as CatalogueIndex.build: tuned on other rows than the recall is measured on
        tuning = tune_k_factor(index, truth.subset(tune), cfg.k_factors, cfg.target_recall, params)
    recall = recall_on(index, truth.subset(check))
    phase("tune_and_recall")
    meta = {
        "format": FORMAT, "type": cfg.type, "requested_type": cfg.type, "ondisk": True, "shards": len(paths),
        "dim": dim, "count": total, "model_sha256": model_sha256, f"recall@{RECALL_K}": recall,
        "recall_measured_on": total, "params": params,
        **({"k_factor_tuning": tuning} if tuning else {}),
        **({"refine_store": REFINE_FILE} if refined else {}),
        "build_s": seconds,
        "sha256": {name: file_digest(directory / name) for name in (*files, IDS_FILE)},
    }
    write_json(directory / META_FILE, meta)  # last: it names the bytes of the others
    return CatalogueIndex(index, ids, meta)


def streamed_recall(index: faiss.Index, shards: Sequence[Path], sample: int, seed: int,
                    k: int = RECALL_K) -> float:
    """recall@k of `index` against exact search, with the exact top-k merged shard by shard (one shard in
    memory at a time). Queries: `sample` catalogue rows, each held out of its own results (leave-one-out)."""
    return recall_on(index, streamed_truth(shards, sample_rows(sum(_rows(shards)), sample, seed), k))


def streamed_truth(shards: Sequence[Path], rows: np.ndarray, k: int = RECALL_K) -> GroundTruth:
    """The exact neighbours of the catalogue rows `rows` (sorted), each held out of its own results, merged
    shard by shard (one shard in memory at a time)."""
    counts = _rows(shards)
    total = sum(counts)
    k = min(k, total - 1)
    starts = np.cumsum([0, *counts])
    queries = np.concatenate([unit_rows(read_embeddings(s)[1], "embeddings")[
        rows[(rows >= a) & (rows < b)] - a] for s, a, b in zip(shards, starts, starts[1:])])
    if k < 1:
        return GroundTruth(queries, None, None, rows, k)  # one row: nothing to rank
    wide = min(k + TIE_SLACK, total - 1)
    best_s = np.full((len(rows), wide), -np.inf, dtype=np.float32)
    best_i = np.full((len(rows), wide), -1, dtype=np.int64)
    for shard, a, b in zip(shards, starts, starts[1:]):
        refs = unit_rows(read_embeddings(shard)[1], "embeddings")
        # a query inside this shard is left out of its own results, by row
        local = np.where((rows >= a) & (rows < b), rows - a, -1)
        s, i = knn_search(queries, refs, min(wide + 1, len(refs)))
        i = np.where(i == local[:, None], -1, i + a)
        s = np.where(i < 0, -np.inf, s)
        merged_s, merged_i = np.concatenate([best_s, s], 1), np.concatenate([best_i, i], 1)
        order = np.argsort(-merged_s, axis=1, kind="stable")[:, :wide]
        best_s, best_i = np.take_along_axis(merged_s, order, 1), np.take_along_axis(merged_i, order, 1)
    return GroundTruth(queries, best_i, best_s, rows, k)


def shards_model(shards: Sequence[str | Path]) -> str:
    """The sha256 of the model that embedded `shards` (recorded by `xbn embed`); refuses a mix of models,
    whose embeddings are not comparable."""
    import pyarrow.parquet as pq

    found = {(pq.read_schema(s).metadata or {}).get(b"xbn.model_sha256", b"").decode() for s in shards}
    if len(found) != 1:
        raise DatasetError(f"the shards were embedded by {len(found)} different models: re-embed them with one")
    return found.pop()


def _id_columns(shard: Path) -> pd.DataFrame:
    """A shard's path (and label) columns, without reading its embeddings."""
    import pyarrow.parquet as pq

    names = [n for n in pq.read_schema(shard).names if n != "embedding"]
    return pq.read_table(shard, columns=names).to_pandas()


def _dim(shard: Path) -> int:
    import pyarrow.parquet as pq

    recorded = (pq.read_schema(shard).metadata or {}).get(b"xbn.embedding_dim")  # written by `xbn embed`
    return int(recorded) if recorded else int(read_embeddings(shard)[1].shape[1])
