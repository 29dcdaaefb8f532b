"""The catalogue index: exact and approximate types, recall against exact search, save/load, append."""

from __future__ import annotations

import json
import logging

import numpy as np
import pandas as pd
import pytest

from xbn.serving.index import (
    CatalogueIndex,
    IndexConfig,
    IndexMismatch,
    append_catalogue,
    build_catalogue,
    recall_at_k,
)
from xbn.serving.sources import read_source


def clustered(n: int, dim: int = 32, centres: int = 50, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((centres, dim))
    x = c[rng.integers(0, centres, n)] + 0.6 * rng.standard_normal((n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def ids_for(n: int, start: int = 0) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "path": [f"img/{i}.png" for i in range(start, start + n)],
            "label": [str(i % 7) for i in range(start, start + n)],
        }
    )


def test_flat_recall_is_one_and_search_matches_brute_force():
    x = clustered(500)
    idx = CatalogueIndex.build(x, ids_for(500), IndexConfig(type="flat"))
    assert idx.meta["recall@10"] == 1.0
    assert idx.meta["type"] == "flat" and idx.meta["count"] == 500 and idx.meta["dim"] == 32
    scores, rows = idx.search(x[:5], 10)
    brute = np.argsort(-(x[:5] @ x.T), axis=1)[:, :10]
    np.testing.assert_array_equal(rows, brute)
    np.testing.assert_allclose(scores, np.take_along_axis(x[:5] @ x.T, brute, 1), atol=1e-5)


@pytest.mark.parametrize(
    "kind, extra",
    [
        ("ivf_flat", {"nlist": 32, "nprobe": 4}),
        ("ivf_pq", {"nlist": 16, "nprobe": 8, "pq_m": 8, "pq_nbits": 4}),
        ("hnsw", {"hnsw_m": 16, "ef_search": 32}),
    ],
)
def test_approximate_types_measure_their_recall(kind, extra):
    x = clustered(1500)
    cfg = IndexConfig(type=kind, min_rows_approx=0, recall_queries=200, **extra)
    idx = CatalogueIndex.build(x, ids_for(1500), cfg)
    assert idx.meta["type"] == kind and idx.meta["params"]["nprobe" if "nprobe" in extra else "ef_search"]
    recall = idx.meta["recall@10"]
    assert 0.2 < recall <= 1.0
    # The recorded number is what recall_at_k measures again on the same held-out sample.
    assert recall_at_k(idx.index, x, sample=200) == pytest.approx(recall)
    if kind == "ivf_flat":  # visiting every cell is exact search
        idx.index.nprobe = 32
        assert recall_at_k(idx.index, x, sample=200) == 1.0


def test_ivf_nprobe_trades_recall():
    x = clustered(3000)
    few = CatalogueIndex.build(
        x, ids_for(3000), IndexConfig(type="ivf_flat", min_rows_approx=0, nlist=64, nprobe=1)
    )
    many = CatalogueIndex.build(
        x, ids_for(3000), IndexConfig(type="ivf_flat", min_rows_approx=0, nlist=64, nprobe=16)
    )
    assert few.meta["recall@10"] < many.meta["recall@10"]


def test_small_catalogue_falls_back_to_flat(caplog):
    with caplog.at_level(logging.INFO, logger="xbn.serving.index"):
        idx = CatalogueIndex.build(clustered(300), ids_for(300), IndexConfig(type="ivf_pq"))
    assert idx.meta["type"] == "flat" and idx.meta["requested_type"] == "ivf_pq"
    assert idx.meta["recall@10"] == 1.0
    assert "building flat (exact) instead of ivf_pq" in caplog.text


def test_pq_m_must_divide_dimension():
    with pytest.raises(ValueError, match=r"pq_m \(5\) must divide the embedding dimension \(32\)"):
        CatalogueIndex.build(
            clustered(500), ids_for(500), IndexConfig(type="ivf_pq", min_rows_approx=0, pq_m=5)
        )


def test_config_refuses_unknown_type_and_keys():
    with pytest.raises(ValueError, match="type"):
        IndexConfig(type="annoy")
    with pytest.raises(ValueError, match="nlists"):
        IndexConfig(nlists=3)


@pytest.mark.parametrize("kind", ["flat", "ivf_pq", "hnsw"])
def test_saved_and_loaded_index_searches_identically(tmp_path, kind):
    x = clustered(1000, seed=1)
    cfg = IndexConfig(type=kind, min_rows_approx=0, nlist=16, nprobe=3, pq_m=8, pq_nbits=4, ef_search=20)
    idx = CatalogueIndex.build(x, ids_for(1000), cfg, model_sha256="ab" * 32)
    idx.save(tmp_path / "index")
    assert sorted(p.name for p in (tmp_path / "index").iterdir()) == [
        "ids.parquet",
        "index.faiss",
        "index.json",
    ]
    meta = json.loads((tmp_path / "index" / "index.json").read_text())
    assert meta["model_sha256"] == "ab" * 32 and meta["count"] == 1000 and meta["type"] == kind
    assert "recall@10" in meta
    loaded = CatalogueIndex.load(tmp_path / "index")
    queries = clustered(50, seed=9)
    for a, b in zip(idx.search(queries, 10), loaded.search(queries, 10)):
        np.testing.assert_array_equal(a, b)
    pd.testing.assert_frame_equal(idx.ids, loaded.ids)
    assert loaded.ids.columns.tolist() == ["path", "label", "row"]


def test_load_refuses_a_folder_whose_files_do_not_match(tmp_path):
    idx = CatalogueIndex.build(clustered(100), ids_for(100), IndexConfig())
    idx.save(tmp_path)
    other = CatalogueIndex.build(clustered(100, seed=3), ids_for(100, start=5), IndexConfig())
    other.ids.to_parquet(tmp_path / "ids.parquet", index=False)  # a half-finished later write
    with pytest.raises(IndexMismatch, match="ids.parquet is not the file index.json records"):
        CatalogueIndex.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="run `xbn index` first"):
        CatalogueIndex.load(tmp_path / "nowhere")


def test_append_adds_only_new_paths():
    x = clustered(400)
    idx = CatalogueIndex.build(x[:300], ids_for(300), IndexConfig())
    # 250..399: 50 already present, plus a repeat of a new path within the batch
    ids = pd.concat([ids_for(150, start=250), ids_for(1, start=399)], ignore_index=True)
    added = idx.append(np.concatenate([x[250:400], x[399:400]]), ids)
    assert added == 100 and idx.count == 400 == len(idx.ids)
    assert idx.ids["row"].tolist() == list(range(400))
    assert idx.ids["path"].is_unique
    _, rows = idx.search(x[350:351], 1)
    assert idx.ids["path"][rows[0, 0]] == "img/350.png"


class CountingModel:
    """The served tiny embedder, counting the images it embeds (a real model: only the count is added)."""

    def __init__(self, served):
        self.served = served
        self.rows = 0

    def __getattr__(self, name):
        return getattr(self.served, name)

    def embed_frame(self, frame, *args, **kwargs):
        self.rows += len(frame)
        return self.served.embed_frame(frame, *args, **kwargs)


def test_build_from_images_and_append_does_not_reembed(served, image_root, tmp_path):
    frame, root = read_source(image_root / "manifest.csv")
    first, later = frame.iloc[:16], frame
    model = CountingModel(served)
    idx = build_catalogue(model, first, root, IndexConfig(batch_size=5))
    assert model.rows == 16 and idx.count == 16 and idx.meta["model_sha256"] == served.sha256
    idx.save(tmp_path / "index")
    idx = CatalogueIndex.load(tmp_path / "index")
    assert append_catalogue(idx, model, later, root) == len(frame) - 16
    assert model.rows == len(frame)  # only the 8 new images were embedded
    assert append_catalogue(idx, model, later, root) == 0 and model.rows == len(frame)
    # The appended rows are the ones a fresh build over everything has.
    fresh = build_catalogue(served, frame, root, IndexConfig())
    emb = served.embed_frame(frame, root).embeddings
    for a, b in zip(idx.search(emb, 5), fresh.search(emb, 5)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_unreadable_catalogue_images_are_left_out_and_named(served, image_root, broken_image):
    frame = pd.DataFrame(
        {
            "path": ["class0/img0.png", str(broken_image), "class1/img0.png"],
            "label": ["class0", "x", "class1"],
        }
    )
    idx = build_catalogue(served, frame, image_root, IndexConfig())
    assert idx.count == 2 and idx.meta["skipped"] == [str(broken_image)]


def test_index_refuses_another_model(served):
    idx = CatalogueIndex.build(clustered(20, dim=16), ids_for(20), IndexConfig(), model_sha256="0" * 64)
    with pytest.raises(IndexMismatch, match="rebuild it"):
        idx.check_model(served.sha256)


def test_index_source_builds_then_appends(served, image_root, tmp_path):
    from xbn.serving.index import index_source

    subset = tmp_path / "subset.csv"
    full = pd.read_csv(image_root / "manifest.csv")
    full.iloc[:10].to_csv(subset, index=False)
    cfg = IndexConfig(source=str(subset), output=str(tmp_path / "index"))
    assert index_source(served, cfg, root=image_root).count == 10
    model = CountingModel(served)
    grown = index_source(
        model, cfg.model_copy(update={"source": str(image_root / "manifest.csv")}), append=True
    )
    assert grown.count == 24 and model.rows == 14
    assert CatalogueIndex.load(tmp_path / "index").count == 24


def test_a_gpu_faiss_cannot_use_falls_back_to_the_cpu(monkeypatch, caplog):
    # faiss-cpu here: told it sees a GPU, moving an index there fails (no GPU classes); building and searching
    # must then run on the CPU with a warning, and give exactly the CPU results.
    import faiss

    x = clustered(3000)
    cfg = IndexConfig(type="ivf_flat", min_rows_approx=0, nlist=32, nprobe=4)
    cpu = CatalogueIndex.build(x, ids_for(3000), cfg)
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 1)
    with caplog.at_level(logging.WARNING, logger="xbn.serving.index"):
        fallback = CatalogueIndex.build(x, ids_for(3000), cfg)
        scores, rows = fallback.search(x[:50], 10)
    assert "cannot use them for IndexIVFFlat" in caplog.text and "staying on the CPU" in caplog.text
    expected_scores, expected_rows = cpu.search(x[:50], 10)
    np.testing.assert_array_equal(rows, expected_rows)
    np.testing.assert_allclose(scores, expected_scores, rtol=0, atol=1e-6)
    assert fallback.meta["recall@10"] == cpu.meta["recall@10"]
