"""A faiss index over a catalogue's embeddings, tied to the model that embedded it.

Embeddings are unit vectors and every index uses the inner product, so scores are cosine similarities, as in
the evaluation (`xbn.evaluation.knn`). Four types: `flat` (exact), `ivf_flat`, `ivf_pq` and `hnsw`.

Below `min_rows_approx` rows (10 000 by default) an approximate type falls back to flat: IVF-PQ's 8-bit
codebooks need 256 training points per centroid and faiss asks for 39 per IVF cell, so a smaller catalogue
trains them badly, while exact search over 10 000 x 512 floats takes 1 to 3 ms per query on one core, so
approximation has little to buy there.

IVF-PQ alone stops short: at 1M rows its recall@10 of exact levelled off at 0.61 whatever the nprobe, bounded
by the codes' quantisation error. So `ivf_pq` is wrapped in faiss's `IndexRefine` (`index.refine`, default
fp16): the PQ search returns k x k_factor candidates, re-ranked by the exact inner product with vectors kept
beside the codes. fp16 halves flat's memory (1 KB a 512-d row) and matched its recall to 0.001 on 100k rows of
the benchmark's catalogue; k_factor is chosen at build time (`tune_k_factor`), the smallest of
`index.k_factors` reaching `index.target_recall` on held-out catalogue rows.

On disk an index is a folder of three files, each written atomically: `index.faiss`, `ids.parquet` (path,
label, row) and `index.json` (type, dimension, count, the model's sha256, the measured recall@10, the k_factor
tuning of a refined IVF-PQ, and the sha256 of the other two). `index.json` is written last and names the bytes
of the other two, so a reader never pairs an index with the id map of another write. An on-disk IVF
(`xbn.serving.shards`) adds `index.ivfdata` and, re-ranked, `refine.npy` (`xbn.serving.mapped_refine`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pandas as pd

from xbn.config import IndexConfig
from xbn.config.schema import IndexType
from xbn.evaluation.knn import as_float32_matrix, knn_search
from xbn.serving.mapped_refine import MappedRefine, StoreMismatch, open_store
from xbn.serving.model import ServedModel
from xbn.serving.sources import read_source
from xbn.utils.errors import IntegrityError
from xbn.utils.faults import fault_point
from xbn.utils.integrity import verify_listed
from xbn.utils.io import atomic_folder, file_digest, write_json

log = logging.getLogger(__name__)

INDEX_FILE, IDS_FILE, META_FILE = "index.faiss", "ids.parquet", "index.json"
FORMAT = "xbn-index/1"
RECALL_K = 10
_MIN_POINTS_PER_CELL = 39  # faiss's k-means warns below this many training points per centroid


class IndexMismatch(ValueError):
    """An index used with a model other than the one that built it, or an inconsistent index folder."""


def effective_type(cfg: IndexConfig, rows: int) -> IndexType:
    """The type actually built for `rows` rows (see the module docstring for the fallback)."""
    if cfg.type != "flat" and rows < cfg.min_rows_approx:
        log.info(
            "index: %d rows < index.min_rows_approx (%d): building flat (exact) instead of %s",
            rows,
            cfg.min_rows_approx,
            cfg.type,
        )
        return "flat"
    return cfg.type


def ivf_spec(cfg: IndexConfig, kind: IndexType, n: int, dim: int) -> tuple[str, dict[str, Any]]:
    """The faiss factory string of an IVF index over `n` rows of `dim` and the parameters it records."""
    nlist = cfg.nlist or max(1, min(int(4 * math.sqrt(n)), n // _MIN_POINTS_PER_CELL))
    if nlist > n:
        raise ValueError(f"index.nlist ({nlist}) exceeds the {n} rows to train on")
    params: dict[str, Any] = {"nlist": nlist, "nprobe": cfg.nprobe}
    if kind != "ivf_pq":
        return f"IVF{nlist},Flat", params
    if dim % cfg.pq_m:
        raise ValueError(f"index.pq_m ({cfg.pq_m}) must divide the embedding dimension ({dim})")
    params.update(pq_m=cfg.pq_m, pq_nbits=cfg.pq_nbits)
    # "np": no polysemous training (faiss's factory default for 8-bit codes). It reorders the codes for Hamming
    # pre-filtering, which `search` never uses; the ADC distances are the same. Training IVF141,PQ64x8 on 6000
    # rows took 214 s with it, 13 s without (one core, benchmarks/serving_bench).
    return f"IVF{nlist},PQ{cfg.pq_m}x{cfg.pq_nbits}np", params


def build_faiss(x: np.ndarray, cfg: IndexConfig, kind: IndexType) -> tuple[faiss.Index, dict[str, Any]]:
    """An inner-product faiss index of type `kind` holding the unit rows `x`, and the parameters it got (a
    refined IVF-PQ starts at k_factor 1: `tune_k_factor` chooses it)."""
    n, dim = x.shape
    params: dict[str, Any] = {}
    if kind in ("ivf_flat", "ivf_pq"):
        spec, params = ivf_spec(cfg, kind, n, dim)
    elif kind == "hnsw":
        params.update(hnsw_m=cfg.hnsw_m, ef_construction=cfg.ef_construction, ef_search=cfg.ef_search)
        spec = f"HNSW{cfg.hnsw_m},Flat"
    else:
        spec = "Flat"
    index = faiss.index_factory(dim, spec, faiss.METRIC_INNER_PRODUCT)
    if kind == "hnsw":
        assert isinstance(index, faiss.IndexHNSW)  # the factory returns the index as its own class
        index.hnsw.efConstruction = cfg.ef_construction  # must be set before the first add
    # k-means of IVF training is what costs; on a GPU it trains there and comes back to the CPU to be saved.
    on_gpu = on_gpus(index)
    if not on_gpu.is_trained:
        on_gpu.train(x)
    on_gpu.add(x)
    if on_gpu is not index:
        index = faiss.index_gpu_to_cpu(on_gpu)
    if kind == "ivf_pq" and cfg.refine != "none":
        index = refined(index, cfg.refine, x)
        params.update(refine=cfg.refine, k_factor=1)
    set_search_params(index, params)
    return index, params


def refined(base: faiss.Index, store: str, x: np.ndarray) -> faiss.IndexRefine:
    """`base` (holding the rows `x`) wrapped in faiss's IndexRefine, which re-ranks base's candidates by the
    exact inner product with `x` kept in an fp16 (`store` "fp16") or float32 ("flat") refine index."""
    exact = refine_store(store, base.d)
    exact.add(x)
    return faiss.IndexRefine(base, exact)  # faiss's Python wrapper keeps both alive with it


def refine_store(store: str, dim: int) -> faiss.Index:
    """An empty inner-product index keeping vectors in fp16 (`store` "fp16") or float32 ("flat")."""
    if store == "flat":
        return faiss.IndexFlatIP(dim)
    return faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)


def on_gpus(index: faiss.Index) -> faiss.Index:
    """A copy of `index` on every GPU when faiss has GPU support and sees a GPU (`faiss.get_num_gpus()`,
    faiss-gpu: `pip install .[gpu]`), else `index` itself. HNSW has no faiss GPU form and stays on the CPU,
    as does a refined IVF-PQ (its refine store has no GPU form; its base trains on the GPU before it is
    wrapped) and any index the GPU refuses (e.g. an IVF-PQ code size its kernels lack): logged, not fatal."""
    if faiss.get_num_gpus() < 1 or "HNSW" in type(index).__name__ or isinstance(index, faiss.IndexRefine):
        return index
    try:
        if not hasattr(faiss, "StandardGpuResources"):
            raise RuntimeError("this faiss build has no GPU classes (faiss-cpu)")
        return faiss.index_cpu_to_all_gpus(index)
    except RuntimeError as exc:
        log.warning("faiss sees %d GPU(s) but cannot use them for %s (%s): staying on the CPU",
                    faiss.get_num_gpus(), type(index).__name__, exc)
        return index


def set_search_params(index: faiss.Index | MappedRefine, params: dict[str, Any]) -> None:
    """Apply the query-time knobs (not all survive faiss's own serialisation, so they are re-applied)."""
    if isinstance(index, MappedRefine):  # our re-rank over a memory-mapped store: the k_factor is its own
        if "k_factor" in params:
            index.k_factor = int(params["k_factor"])
        index = index.base_index
        params = {key: value for key, value in params.items() if key != "k_factor"}
    # GpuParameterSpace also sets a CPU index (and each replica of a multi-GPU one).
    gpu = hasattr(faiss, "GpuParameterSpace") and faiss.get_num_gpus() > 0
    space = faiss.GpuParameterSpace() if gpu else faiss.ParameterSpace()
    if "nprobe" in params:
        space.set_index_parameter(index, "nprobe", int(params["nprobe"]))
    if "ef_search" in params:
        space.set_index_parameter(index, "efSearch", int(params["ef_search"]))
    if "k_factor" in params:  # IndexRefine's: base candidates = k x k_factor
        space.set_index_parameter(index, "k_factor_rf", int(params["k_factor"]))


def unit_rows(x: Any, name: str) -> np.ndarray:
    """A float32 [N, d] copy with unit rows (the embedder's output already is; this guards other callers)."""
    x = as_float32_matrix(x, name).copy()
    faiss.normalize_L2(x)
    return x


def recall_at_k(
    index: faiss.Index,
    references: np.ndarray,
    queries: np.ndarray | None = None,
    k: int = RECALL_K,
    sample: int = 1000,
    seed: int = 0,
) -> float:
    """Mean fraction of the exact top-k (by `knn_search` over `references`) that `index` returns in its top-k.

    Without `queries`, `sample` catalogue rows are the queries, held out of their own results on both sides
    (leave-one-out: a query finding itself proves nothing). A flat index scores 1.0.
    """
    return recall_on(index, GroundTruth.of(references, queries, k, sample_rows(len(references), sample, seed)))


def sample_rows(n: int, sample: int, seed: int, avoid: np.ndarray | None = None) -> np.ndarray:
    """`sample` of the rows 0..n-1 (sorted, seeded) as held-out queries, outside `avoid` unless none remain."""
    pool = np.arange(n) if avoid is None else np.setdiff1d(np.arange(n), avoid)
    if not len(pool):
        pool = np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(pool, min(sample, len(pool)), replace=False))


# A returned neighbour counts as found when its exact similarity is within TIE_TOLERANCE of the exact k-th
# one's (ann-benchmarks' recall): the catalogue can hold duplicate images, and two exact searches that sum in
# another order may rank equal scores either way round (float32 on unit vectors of d <= 2048 differs by
# about 1e-6). TIE_SLACK more exact neighbours than k are kept to know the ids tied with the k-th.
TIE_TOLERANCE = 1e-5
TIE_SLACK = 10


@dataclass
class GroundTruth:
    """Queries and their exact neighbours: computed once, so several settings of one index are scored on them.
    `exact` and `scores`: the ids and similarities of each query's exact top k + TIE_SLACK, best first.
    `rows`: the catalogue rows the queries are (each left out of its own results), or None."""

    queries: np.ndarray
    exact: np.ndarray | None  # None: nothing to rank (a one-row catalogue)
    scores: np.ndarray | None
    rows: np.ndarray | None
    k: int

    @classmethod
    def of(cls, references: Any, queries: Any, k: int, rows: np.ndarray | None = None) -> GroundTruth:
        """Exact neighbours of `queries` over `references`; without `queries`, of the catalogue `rows`."""
        references = as_float32_matrix(references, "references")
        if queries is None:
            queries = references[rows]
        else:
            queries, rows = unit_rows(queries, "queries"), None
        k = min(k, len(references) - int(rows is not None))
        if k < 1 or not len(queries):
            return cls(queries, None, None, rows, k)
        scores, exact = knn_search(queries, references, k + TIE_SLACK, exclude=rows)
        return cls(queries, exact, scores, rows, k)

    def subset(self, rows: np.ndarray) -> GroundTruth:
        """The queries that are the catalogue rows `rows` (all among `self.rows`)."""
        assert self.rows is not None  # queries that are catalogue rows
        keep = np.isin(self.rows, rows)
        exact, scores = (None, None) if self.exact is None or self.scores is None else \
            (self.exact[keep], self.scores[keep])
        return GroundTruth(self.queries[keep], exact, scores, self.rows[keep], self.k)

    def found(self, i: int, got: np.ndarray) -> int:
        """How many of the ids `got` (a top k) are among query i's exact top k, ties with the k-th included."""
        assert self.exact is not None and self.scores is not None  # recall_on skips a truth without them
        good = self.exact[i][self.scores[i] >= self.scores[i, self.k - 1] - TIE_TOLERANCE]
        return len(set(good.tolist()) & set(got.tolist()))


def recall_on(index: faiss.Index | MappedRefine, truth: GroundTruth) -> float:
    """recall@k of `index` (as it is set now) on `truth`'s queries (a neighbour tied with the k-th counts)."""
    if truth.exact is None:
        return 1.0  # nothing to rank: no way to miss
    held_out = int(truth.rows is not None)
    _, approx = index.search(truth.queries, truth.k + held_out)  # one more: the query's own row is dropped
    found = 0
    for i, got in enumerate(approx):
        if truth.rows is not None:
            got = got[got != truth.rows[i]]
        found += truth.found(i, got[: truth.k])
    return found / (truth.k * len(truth.queries))


def tune_k_factor(
    index: faiss.Index | MappedRefine, truth: GroundTruth, ladder: list[int], target: float,
    params: dict[str, Any]
) -> dict[str, Any]:
    """Set `index` (an IndexRefine) to the smallest k_factor of `ladder` whose recall@k on `truth` reaches
    `target`; when none does, to the smallest within 0.005 of the best (more candidates only cost time, and
    it is nprobe that bounds recall then). Updates `params["k_factor"]`; returns the record for index.json."""
    tried = []
    for k_factor in ladder:
        set_search_params(index, {"k_factor": k_factor})
        tried.append({"k_factor": k_factor, "recall": round(recall_on(index, truth), 4)})
        if tried[-1]["recall"] >= target:
            break
    reached = tried[-1]["recall"] >= target
    best = max(t["recall"] for t in tried)
    chosen = min(t["k_factor"] for t in tried if t["recall"] >= (target if reached else best - 0.005))
    if not reached:
        log.warning("index: no k_factor of %s reaches recall@%d %.3f (best %.4f): k_factor %d; rows "
                    "outside the %s probed cells cannot be found, raise index.nprobe", ladder, truth.k, target,
                    best, chosen, params.get("nprobe"))
    params["k_factor"] = chosen
    set_search_params(index, params)
    return {"target_recall": target, "reached": reached, "k_factor": chosen, "queries": len(truth.queries),
            "ladder": tried}


@dataclass
class CatalogueIndex:
    """A faiss index, its id map (`path`, `label`, `row`: row i of the index is catalogue item i) and its
    record (`meta`: type, dim, count, model_sha256, recall@10, parameters)."""

    index: faiss.Index | MappedRefine
    ids: pd.DataFrame
    meta: dict[str, Any] = field(default_factory=dict)
    # `index` on the GPUs, made on first use
    _searcher: faiss.Index | MappedRefine | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls, embeddings: Any, ids: pd.DataFrame, cfg: IndexConfig, model_sha256: str = "", queries: Any = None
    ) -> CatalogueIndex:
        """Index `embeddings` (row i is `ids` row i: columns path, label) and measure its recall@10 against
        exact search on held-out queries (`queries`, else a sample of the catalogue)."""
        x = unit_rows(embeddings, "embeddings")
        if len(x) != len(ids):
            raise ValueError(f"{len(x)} embeddings but {len(ids)} id rows")
        if not len(x):
            raise ValueError("the catalogue is empty: nothing to index")
        kind = effective_type(cfg, len(x))
        index, params = build_faiss(x, cfg, kind)
        check = sample_rows(len(x), cfg.recall_queries, cfg.seed)
        tuning = None
        if "k_factor" in params:  # tuned on other catalogue rows than those the recall is measured on
            avoid = None if queries is not None else check
            tune = sample_rows(len(x), cfg.recall_queries, cfg.seed + 1, avoid)
            truth = GroundTruth.of(x, None, RECALL_K, tune)
            tuning = tune_k_factor(index, truth, cfg.k_factors, cfg.target_recall, params)
        recall = recall_on(index, GroundTruth.of(x, queries, RECALL_K, check))
        log.info(
            "index: %s over %d x %d, recall@%d %.4f of exact%s", kind, len(x), x.shape[1], RECALL_K, recall,
            f" (refined, k_factor {params['k_factor']})" if tuning else "",
        )
        meta = {
            "format": FORMAT,
            "type": kind,
            "requested_type": cfg.type,
            "dim": int(x.shape[1]),
            "count": len(x),
            "model_sha256": model_sha256,
            f"recall@{RECALL_K}": recall,
            "recall_measured_on": len(x),
            "params": params,
        }
        if tuning:
            meta["k_factor_tuning"] = tuning
        return cls(index, _id_map(ids, 0), meta)

    @property
    def count(self) -> int:
        return int(self.index.ntotal)

    @property
    def dim(self) -> int:
        return int(self.index.d)

    def search(self, query_emb: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores float32 [Nq, k'], rows int64 [Nq, k']) best first, k' = min(k, count); a row of -1 marks
        a slot an approximate index could not fill."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        q = unit_rows(query_emb, "queries")
        if q.shape[1] != self.dim:
            raise IndexMismatch(f"queries have dimension {q.shape[1]}, the index {self.dim}")
        if self._searcher is None:  # on-disk lists stay on disk: a GPU copy would load them all
            index = self.index  # a MappedRefine is on disk too
            self._searcher = (index if self.meta.get("ondisk") or isinstance(index, MappedRefine)
                              else on_gpus(index))
            set_search_params(self._searcher, self.meta.get("params", {}))
        return self._searcher.search(q, min(int(k), self.count))

    def check_model(self, sha256: str) -> None:
        """Refuse to serve this index with a model other than the one that embedded it."""
        built = self.meta.get("model_sha256")
        if built and sha256 and built != sha256:
            raise IndexMismatch(
                f"the index was built with model sha256 {built[:12]}..., not with the model "
                f"being served ({sha256[:12]}...): rebuild it (`xbn index`)"
            )

    def missing(self, paths: Any) -> np.ndarray:
        """Boolean mask of `paths` not yet in the catalogue: what `append` would add, so only they need
        embedding."""
        return ~pd.Series(paths, dtype=str).isin(set(self.ids["path"])).to_numpy()

    def append(self, embeddings: Any, ids: pd.DataFrame) -> int:
        """Add rows whose path is not in the catalogue yet (others, and repeats within `ids`, are skipped);
        returns how many were added. The index keeps its type and trained quantizer: a catalogue that has
        grown far past what it was built from is better rebuilt."""
        if self.meta.get("ondisk"):
            raise IndexMismatch("an on-disk index is built from its shards: add a shard and rebuild it "
                                "(xbn.serving.shards.build_sharded) rather than appending")
        x = unit_rows(embeddings, "embeddings")
        if len(x) != len(ids):
            raise ValueError(f"{len(x)} embeddings but {len(ids)} id rows")
        if len(x) and x.shape[1] != self.dim:
            raise IndexMismatch(f"new embeddings have dimension {x.shape[1]}, the index {self.dim}")
        keep = self.missing(ids["path"]) & ~ids["path"].astype(str).duplicated().to_numpy()
        if keep.any():
            assert isinstance(self.index, faiss.Index)  # a MappedRefine is on disk: refused above
            first = self.count
            self.index.add(np.ascontiguousarray(x[keep]))
            self._searcher = None  # a GPU copy would miss the new rows
            self.ids = pd.concat([self.ids, _id_map(ids[keep], first)], ignore_index=True)
            self.meta["count"] = self.count
        log.info("index: %d row(s) appended, %d already present", int(keep.sum()), int((~keep).sum()))
        return int(keep.sum())

    def save(self, directory: str | Path) -> Path:
        """Write the three files into a new folder, `index.json` last (it names the other two's bytes), which then
        replaces `directory` whole (`atomic_folder`): two builders of one output leave one's index, never a mix
        that the hashes would certify."""
        directory = Path(directory)
        assert isinstance(self.index, faiss.Index), "an on-disk index is written by xbn.serving.shards"
        with atomic_folder(directory) as building:
            faiss.write_index(self.index, str(building / INDEX_FILE))
            self.ids.to_parquet(building / IDS_FILE, index=False)
            meta = {
                **self.meta,
                "count": self.count,
                "dim": self.dim,
                "sha256": {name: file_digest(building / name) for name in (INDEX_FILE, IDS_FILE)},
            }
            write_json(building / META_FILE, meta)
            fault_point("index.before_swap")
        self.meta = meta
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> CatalogueIndex:
        """Read a saved index, checking that its files are the ones its `index.json` records."""
        import json

        directory = Path(directory)
        try:
            meta = json.loads((directory / META_FILE).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no index at {directory} (no {META_FILE}): run `xbn index` first"
            ) from None
        if meta.get("format") != FORMAT:
            raise IndexMismatch(
                f"{directory / META_FILE}: format {meta.get('format')!r}, expected {FORMAT!r}"
            )
        try:
            verify_listed(directory, meta.get("sha256", {}), str(directory / META_FILE))
        except IntegrityError as exc:
            raise IndexMismatch(f"{exc} (a write was interrupted or the folder was altered; rebuild the index)"
                                ) from None
        # An on-disk index (xbn.serving.shards) memory-maps the .ivfdata beside it, wherever the folder now is,
        # and its re-rank store (REFINE_FILE, when it has one).
        flags = faiss.IO_FLAG_ONDISK_SAME_DIR if meta.get("ondisk") else 0
        base = faiss.read_index(str(directory / INDEX_FILE), flags)
        index: faiss.Index | MappedRefine = base
        if meta.get("refine_store"):
            try:
                index = MappedRefine(base, open_store(directory / meta["refine_store"], base.ntotal, base.d))
            except StoreMismatch as exc:
                raise IndexMismatch(str(exc)) from None
        set_search_params(index, meta.get("params", {}))
        ids = pd.read_parquet(directory / IDS_FILE)
        if not (index.ntotal == len(ids) == meta["count"]):
            raise IndexMismatch(
                f"{directory}: index holds {index.ntotal} rows, id map {len(ids)}, "
                f"{META_FILE} says {meta['count']}"
            )
        return cls(index, ids, meta)


def _id_map(ids: pd.DataFrame, first_row: int) -> pd.DataFrame:
    labels = ids["label"] if "label" in ids.columns else pd.Series([None] * len(ids))
    return pd.DataFrame(
        {
            "path": ids["path"].astype(str).to_numpy(),
            "label": [None if pd.isna(v) else str(v) for v in labels],
            "row": np.arange(first_row, first_row + len(ids), dtype=np.int64),
        }
    )


def build_catalogue(
    model: ServedModel,
    frame: pd.DataFrame,
    root: str | Path,
    cfg: IndexConfig,
    queries: Any = None,
    num_workers: int | str = 0,
) -> CatalogueIndex:
    """Embed the catalogue rows `frame` (path relative to `root`, label) with `model` and index them;
    unreadable images are left out (logged by name) and recorded in `meta["skipped"]`."""
    emb, kept, skipped = model.embed_frame(frame, root, cfg.batch_size, num_workers)
    catalogue = CatalogueIndex.build(emb, frame.iloc[kept], cfg, model.sha256, queries)
    catalogue.meta["skipped"] = skipped
    catalogue.meta["inference"] = model.record()  # the mode that embedded it (`xbn.evaluation.inference`)
    return catalogue


def append_catalogue(
    catalogue: CatalogueIndex,
    model: ServedModel,
    frame: pd.DataFrame,
    root: str | Path,
    batch_size: int = 64,
    num_workers: int | str = 0,
) -> int:
    """Add the rows of `frame` not yet in the catalogue, embedding only those; returns how many were added."""
    catalogue.check_model(model.sha256)
    new = frame[catalogue.missing(frame["path"])]
    emb, kept, skipped = model.embed_frame(new, root, batch_size, num_workers)
    catalogue.meta["skipped"] = sorted({*catalogue.meta.get("skipped", []), *skipped})
    return catalogue.append(emb, new.iloc[kept])


def index_source(
    model: ServedModel,
    cfg: IndexConfig,
    *,
    manifest: str | Path | None = None,
    root: str | Path | None = None,
    append: bool = False,
    queries: Any = None,
    num_workers: int | str = 0,
) -> CatalogueIndex:
    """What `xbn index [--append]` does: embed `cfg.source` with `model`, build (or, with `append`, extend
    the index at `cfg.output` without re-embedding what it holds) and save it to `cfg.output`."""
    frame, root = read_source(cfg.source, manifest=manifest, root=root)
    if append and (Path(cfg.output) / META_FILE).exists():
        catalogue = CatalogueIndex.load(cfg.output)
        append_catalogue(catalogue, model, frame, root, cfg.batch_size, num_workers)
    else:
        if append:
            log.info("index: nothing at %s to append to, building it", cfg.output)
        catalogue = build_catalogue(model, frame, root, cfg, queries, num_workers)
    catalogue.save(cfg.output)
    return catalogue
