"""The on-disk IVF index built from embedding shards (faiss's merge_ondisk), at small scale: it searches like
the in-memory index, its lists live in the memory-mapped .ivfdata, and the folder loads wherever it is moved."""

from __future__ import annotations

import json
import shutil
from itertools import pairwise

import faiss
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from serving_support import PQ, clustered, exact_top10_found, product_like, write_shard

from xbn.config import IndexConfig
from xbn.evaluation.knn import knn_search
from xbn.serving.index import CatalogueIndex, IndexMismatch, recall_at_k, unit_rows
from xbn.serving.mapped_refine import REFINE_FILE, MappedRefine
from xbn.serving.shards import IVFDATA_FILE, build_sharded

SIZES = (700, 500, 800)  # three machines' parts of the catalogue


@pytest.fixture
def shards(tmp_path):
    x = clustered(sum(SIZES), dim=16)
    bounds = np.cumsum([0, *SIZES])
    return x, [write_shard(tmp_path / f"part{i}.parquet", x[a:b], a)
               for i, (a, b) in enumerate(pairwise(bounds))]


def test_visiting_every_cell_is_exact_search_over_all_shards(shards, tmp_path):
    x, files = shards
    built = build_sharded(files, tmp_path / "index", IndexConfig(type="ivf_flat", nlist=16, nprobe=16))
    assert built.meta["recall@10"] == 1.0 and built.count == len(x) == 2000
    # The lists are on disk (memory-mapped), not in RAM.
    assert isinstance(faiss.downcast_InvertedLists(faiss.extract_index_ivf(built.index).invlists),
                      faiss.OnDiskInvertedLists)
    assert (tmp_path / "index" / IVFDATA_FILE).stat().st_size >= x.nbytes

    # Moved (as a registry download moves it), the folder loads and searches the same: exact top-10, and
    # row r of the id map is row r of the shards in turn.
    moved = tmp_path / "elsewhere" / "index"
    shutil.copytree(tmp_path / "index", moved)
    shutil.rmtree(tmp_path / "index")
    loaded = CatalogueIndex.load(moved)
    scores, rows = loaded.search(x[::97], 10)
    exact_scores, exact_rows = knn_search(x[::97], x, 10)
    np.testing.assert_array_equal(rows, exact_rows)
    np.testing.assert_allclose(scores, exact_scores, atol=1e-5)
    assert loaded.ids["path"].tolist() == [f"part/{i}.png" for i in range(2000)]
    assert loaded.ids["row"].tolist() == list(range(2000))

    with pytest.raises(IndexMismatch, match="rebuild"):
        loaded.append(x[:2], pd.DataFrame({"path": ["new/a.png", "new/b.png"], "label": ["0", "1"]}))


def test_recall_streamed_over_the_shards_equals_recall_in_memory(shards, tmp_path):
    # nprobe 2 of 16 cells: approximate. The recall is measured shard by shard; held in memory all at once,
    # the same queries (same seed) must give the same number.
    x, files = shards
    built = build_sharded(files, tmp_path / "index", IndexConfig(type="ivf_flat", nlist=16, nprobe=2),
                          recall_queries=300)
    expected = recall_at_k(built.index, x, sample=300, seed=0)
    assert 0.3 < built.meta["recall@10"] < 1.0
    assert built.meta["recall@10"] == pytest.approx(expected, abs=1e-12)


def test_on_disk_ivf_pq_is_re_ranked_exactly_with_its_tuned_k_factor(tmp_path):
    x = product_like(20_200)
    x, queries = x[:20_000], x[20_000:]
    bounds = np.cumsum([0, 7000, 5000, 8000])
    files = [write_shard(tmp_path / f"part{i}.parquet", x[a:b], a) for i, (a, b) in enumerate(pairwise(bounds))]
    cfg = {**PQ, "target_recall": 0.99}
    plain = build_sharded(files, tmp_path / "plain", IndexConfig(**cfg, refine="none"))
    built = build_sharded(files, tmp_path / "index", IndexConfig(**cfg))
    assert plain.meta["recall@10"] < 0.75 and "k_factor_tuning" not in plain.meta
    assert not (tmp_path / "plain" / REFINE_FILE).exists()
    tuning, k_factor = built.meta["k_factor_tuning"], built.meta["params"]["k_factor"]
    assert tuning["reached"] and tuning["k_factor"] == k_factor > 1 and built.meta["recall@10"] >= 0.99
    assert [t["k_factor"] for t in tuning["ladder"]][-1] == k_factor
    # The PQ lists stay memory-mapped under the re-rank, and so do the fp16 vectors, in row order.
    assert isinstance(built.index, MappedRefine) and built.index.vectors.dtype == np.float16
    assert isinstance(faiss.downcast_InvertedLists(faiss.extract_index_ivf(built.index.base_index).invlists),
                      faiss.OnDiskInvertedLists)
    assert set(built.meta["build_s"]) == {"train", "fill", "merge", "refine_store", "ids", "exact_truth",
                                          "tune_and_recall"}

    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "index", moved)
    shutil.rmtree(tmp_path / "index")
    loaded = CatalogueIndex.load(moved)
    np.testing.assert_array_equal(loaded.index.vectors, unit_rows(x, "x").astype(np.float16))
    # index.json's k_factor, applied on load
    assert isinstance(loaded.index, MappedRefine) and loaded.index.k_factor == k_factor
    assert exact_top10_found(loaded, x, queries) >= 0.9 > 0.2 > exact_top10_found(plain, x, queries)


def test_only_ivf_types_go_on_disk(shards, tmp_path):
    with pytest.raises(ValueError, match="on-disk index is IVF"):
        build_sharded(shards[1], tmp_path / "index", IndexConfig(type="hnsw"))


def test_xbn_index_shards_builds_the_on_disk_index_at_index_output(shards, tmp_path, monkeypatch, capsys):
    from xbn.cli import main
    from xbn.utils.errors import EXIT_DATA

    _, files = shards
    for f in files:  # as `xbn embed` records it: the model that embedded the shard
        table = pq.read_table(f)
        pq.write_table(table.replace_schema_metadata(
            {**table.schema.metadata, b"xbn.model_sha256": b"ab" * 32}), f)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("{}\n")  # every default but what --set says
    args = ["index", "--shards", *map(str, files), "--set", "tracking.enabled=false", "--set",
            "index.type=ivf_flat", "--set", "index.nlist=16", "--set", "index.nprobe=16"]
    assert main(args) == 0
    report = json.loads((tmp_path / "metrics/index.json").read_text())
    assert (report["ondisk"], report["count"], report["recall@10"], report["model_sha256"]) == (
        True, 2000, 1.0, "ab" * 32)
    assert (tmp_path / "models/index" / IVFDATA_FILE).exists()

    other = pq.read_table(files[0])
    pq.write_table(other.replace_schema_metadata({**other.schema.metadata, b"xbn.model_sha256": b"cd" * 32}),
                   files[0])
    capsys.readouterr()
    assert main(args) == EXIT_DATA  # one line naming the cause, not a traceback
    assert capsys.readouterr().err.strip().endswith("the shards were embedded by 2 different models: re-embed "
                                                    "them with one")
