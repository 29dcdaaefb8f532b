"""The on-disk IVF-PQ's exact re-rank from a memory-mapped store (xbn.serving.mapped_refine), at small scale:
20 000 rows in 3 shards. It ranks the PQ candidates as faiss's own IndexRefine does, lifts recall over PQ alone,
reads the vectors through a memory map it releases after each search, writes the store atomically, and refuses
a store that does not match its index, naming the file."""

from __future__ import annotations

import json
import mmap
import shutil
from itertools import pairwise

import faiss
import numpy as np
import pytest
from serving_support import PQ, product_like, write_shard

from xbn.config import IndexConfig
from xbn.serving.index import CatalogueIndex, IndexMismatch, unit_rows
from xbn.serving.mapped_refine import REFINE_FILE, MappedRefine, StoreMismatch, open_store, write_store
from xbn.serving.shards import build_sharded


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(catalogue rows, new items as queries, the index folder) of a refined on-disk IVF-PQ over 3 shards."""
    tmp = tmp_path_factory.mktemp("mapped")
    x = product_like(20_200)
    x, queries = x[:20_000], x[20_000:]
    bounds = np.cumsum([0, 7000, 5000, 8000])
    files = [write_shard(tmp / f"part{i}.parquet", x[a:b], a) for i, (a, b) in enumerate(pairwise(bounds))]
    build_sharded(files, tmp / "index", IndexConfig(**PQ, target_recall=0.99))
    return unit_rows(x, "x"), unit_rows(queries, "queries"), tmp / "index"


def _recall(rows: np.ndarray, x: np.ndarray, queries: np.ndarray) -> float:
    exact = np.argsort(-(queries @ x.T), axis=1)[:, :10]
    return float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(exact, rows)]))


def test_re_ranked_top10_is_the_exact_top10_of_the_pq_candidates(built):
    x, queries, folder = built
    index = CatalogueIndex.load(folder).index
    assert isinstance(index, MappedRefine) and index.k_factor > 1
    scores, rows = index.search(queries, 10)
    _, candidates = index.base_index.search(queries, 10 * index.k_factor)
    stored = x.astype(np.float16).astype(np.float64)
    for q, found, got_rows, got_scores in zip(queries, candidates, rows, scores):
        exact = stored[found] @ q  # by hand, in float64, over the same candidates
        order = np.argsort(-exact, kind="stable")[:10]
        np.testing.assert_array_equal(got_rows, found[order])
        np.testing.assert_allclose(got_scores, exact[order], atol=1e-5)
    # faiss's own IndexRefine over the same PQ lists and an fp16 store ranks the same (where it can run:
    # with its store in memory).
    store = faiss.IndexScalarQuantizer(x.shape[1], faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
    store.add(x)
    theirs = faiss.IndexRefine(index.base_index, store)
    theirs.k_factor = index.k_factor
    their_scores, their_rows = theirs.search(queries, 10)
    np.testing.assert_array_equal(rows, their_rows)
    np.testing.assert_allclose(scores, their_scores, atol=1e-4)  # fp16 decoded, summed in another order


def test_re_ranking_lifts_recall_over_pq_alone(built):
    x, queries, folder = built
    index = CatalogueIndex.load(folder).index
    pq_only = _recall(index.base_index.search(queries, 10)[1], x, queries)
    refined = _recall(index.search(queries, 10)[1], x, queries)
    assert refined >= 0.97 and pq_only < 0.75


def _mapped_kb(path) -> tuple[bool, int]:
    """(whether the file is mapped into this process, the resident kB of its mappings)."""
    mapped, rss, inside = False, 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = fields[-1] == str(path)
                mapped |= inside
            elif inside and fields[0] == "Rss:":
                rss += int(fields[1])
    return mapped, rss


def test_the_store_is_memory_mapped_and_released_after_each_search(built):
    x, queries, folder = built
    index = CatalogueIndex.load(folder).index
    vectors = index.vectors
    assert isinstance(vectors.base, mmap.mmap) and not vectors.flags.writeable and not vectors.flags.owndata
    path = (folder / REFINE_FILE).resolve()
    mapped, _ = _mapped_kb(path)
    assert mapped
    assert float(vectors[123] @ x[123]) == pytest.approx(1.0, abs=1e-3)  # a read maps pages in
    assert _mapped_kb(path)[1] > 0
    index.search(queries, 10)
    assert _mapped_kb(path)[1] == 0  # the search's pages were released to the page cache


def test_the_store_is_written_atomically(tmp_path):
    path = tmp_path / REFINE_FILE
    blocks = [np.ones((3, 4), np.float32), 2 * np.ones((2, 4), np.float32)]
    write_store(iter(blocks), path, 5, 4)
    np.testing.assert_array_equal(np.load(path), np.concatenate(blocks).astype(np.float16))
    before = path.read_bytes()

    def failing():
        yield blocks[0]
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        write_store(failing(), path, 5, 4)
    with pytest.raises(StoreMismatch, match="4 rows written, 5 announced"):
        write_store(iter(blocks[:1] + [np.ones((1, 4), np.float32)]), path, 5, 4)
    with pytest.raises(StoreMismatch, match=r"shape \(2, 3\), expected rows of 4"):
        write_store(iter([np.ones((2, 3), np.float32)]), path, 2, 4)
    assert path.read_bytes() == before  # the earlier store, whole
    assert [p.name for p in tmp_path.iterdir()] == [REFINE_FILE]  # no temp file left


def test_a_store_that_does_not_match_its_index_is_refused_by_name(built, tmp_path):
    x, _, folder = built
    store = tmp_path / "copy" / REFINE_FILE
    shutil.copytree(folder, store.parent)
    assert open_store(store, *x.shape).shape == x.shape
    with pytest.raises(StoreMismatch, match=rf"{store}: holds \(20000, 64\) float16, the index 20001 x 64"):
        open_store(store, len(x) + 1, x.shape[1])
    with pytest.raises(StoreMismatch, match="the index 20000 x 32"):
        open_store(store, len(x), 32)

    with open(store, "r+b") as fh:  # a copy cut short
        fh.truncate(store.stat().st_size - 1024)
    with pytest.raises(StoreMismatch, match=rf"{store}: .* bytes, .* expected .*truncated"):
        open_store(store, *x.shape)
    with pytest.raises(IndexMismatch, match=f"index file {store}: its sha256 is .* is what .*index.json records"):
        CatalogueIndex.load(store.parent)

    # A folder whose index.json does not vouch for the store (a hand-made one) still gets the store's own check.
    meta = json.loads((store.parent / "index.json").read_text())
    del meta["sha256"][REFINE_FILE]
    (store.parent / "index.json").write_text(json.dumps(meta))
    with pytest.raises(IndexMismatch, match=rf"{store}: .*truncated"):
        CatalogueIndex.load(store.parent)
    store.unlink()
    with pytest.raises(IndexMismatch, match=rf"{store}: the index's refine store is missing"):
        CatalogueIndex.load(store.parent)
