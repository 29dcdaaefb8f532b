"""The catalogue index: exact and approximate types, recall against exact search, save/load, append."""

from __future__ import annotations

import json
import logging

import numpy as np
import pandas as pd
import pytest
from serving_support import PQ, clustered, exact_top10_found, product_like

from xbn.serving.index import (
    CatalogueIndex,
    GroundTruth,
    IndexConfig,
    IndexMismatch,
    append_catalogue,
    build_catalogue,
    recall_at_k,
    recall_on,
)
from xbn.serving.sources import read_source


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


class SwappedTies:
    """An exact index over `x` that returns row j + `shift` where the truth has its duplicate j, as a flat
    index breaking equal scores the other way round would; with `worst`, the k-th neighbour is replaced by
    the catalogue's least similar row, a real miss."""

    def __init__(self, x: np.ndarray, shift: int, worst: bool = False):
        self.x, self.shift, self.worst = x, shift, worst

    def search(self, queries: np.ndarray, k: int):
        sims = queries @ self.x.T
        ids = np.argsort(-sims, axis=1, kind="stable")[:, :k]
        ids = np.where(ids < self.shift, ids + self.shift, ids - self.shift)
        if self.worst:
            ids[:, -1] = np.argmin(sims, axis=1)
        return np.take_along_axis(sims, ids, 1), ids


def test_recall_counts_a_neighbour_tied_with_the_kth_as_found():
    # the catalogue twice over: every row has an exact duplicate, so the exact top 9 (4 pairs and one of the
    # 5th) is a choice between ties, and a flat index may choose the other copy (seen: a flat catalogue
    # index's recall@10 of 0.99896)
    half = clustered(300)
    x = np.concatenate([half, half])
    truth = GroundTruth.of(x, clustered(40, seed=1), 9)
    assert recall_on(SwappedTies(x, 300), truth) == 1.0
    assert recall_on(SwappedTies(x, 300, worst=True), truth) == pytest.approx(8 / 9)


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
    with pytest.raises(IndexMismatch, match=r"ids.parquet: its sha256 is .* is what .*index.json records.*rebuild"):
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


# ---------------------------------------------------------------------------------------------------------
# IVF-PQ re-ranked exactly (IndexRefine) with k_factor chosen at build time


@pytest.fixture(scope="module")
def pq_data():
    x = product_like(20_200)
    return x[:20_000], x[20_000:]  # the catalogue, and new items as queries


@pytest.fixture(scope="module")
def refined(pq_data):
    x, _ = pq_data
    return CatalogueIndex.build(x, ids_for(len(x)), IndexConfig(**PQ, target_recall=0.99))


def test_refined_ivf_pq_finds_the_exact_top10_where_plain_pq_does_not(pq_data, refined):
    x, queries = pq_data
    plain = CatalogueIndex.build(x, ids_for(len(x)), IndexConfig(**PQ, refine="none"))
    assert "k_factor" not in plain.meta["params"] and "k_factor_tuning" not in plain.meta
    assert plain.meta["recall@10"] < 0.75 and exact_top10_found(plain, x, queries) < 0.2
    assert refined.meta["params"]["refine"] == "fp16"
    assert refined.meta["recall@10"] >= 0.99 and exact_top10_found(refined, x, queries) >= 0.9
    # The scores are the exact inner products (to fp16's precision), not PQ's estimates.
    scores, rows = refined.search(queries, 10)
    np.testing.assert_allclose(scores, np.einsum("qd,qkd->qk", queries, x[rows]), atol=2e-3)


def test_k_factor_is_the_smallest_of_the_ladder_reaching_the_target(refined):
    tuning = refined.meta["k_factor_tuning"]
    chosen = refined.meta["params"]["k_factor"]
    assert tuning["k_factor"] == chosen and tuning["reached"] and tuning["target_recall"] == 0.99
    ladder = tuning["ladder"]
    assert [t["k_factor"] for t in ladder] == [1, 2, 4, 8, 16, 32, 64][: len(ladder)]
    assert ladder[-1]["k_factor"] == chosen > 1 and ladder[-1]["recall"] >= 0.99
    assert all(t["recall"] < 0.99 for t in ladder[:-1])
    assert refined.index.k_factor == chosen


def test_k_factor_is_saved_and_applied_on_load(tmp_path, pq_data, refined):
    x, queries = pq_data
    refined.save(tmp_path / "index")
    meta = json.loads((tmp_path / "index" / "index.json").read_text())
    assert meta["params"]["k_factor"] == refined.meta["params"]["k_factor"]
    assert meta["k_factor_tuning"] == refined.meta["k_factor_tuning"]
    loaded = CatalogueIndex.load(tmp_path / "index")
    assert loaded.index.k_factor == meta["params"]["k_factor"]
    for a, b in zip(refined.search(queries, 10), loaded.search(queries, 10)):
        np.testing.assert_array_equal(a, b)
    # The record in index.json is what search uses, whatever faiss's file holds.
    meta["params"]["k_factor"] = 1
    (tmp_path / "index" / "index.json").write_text(json.dumps(meta))
    assert CatalogueIndex.load(tmp_path / "index").index.k_factor == 1


def test_unreachable_target_keeps_the_smallest_k_factor_near_the_best(caplog):
    x = product_like(12_000, seed=2)
    cfg = IndexConfig(**{**PQ, "nprobe": 1}, target_recall=1.0, k_factors=[1, 4, 16, 64])
    with caplog.at_level(logging.WARNING, logger="xbn.serving.index"):
        idx = CatalogueIndex.build(x, ids_for(len(x)), cfg)
    tuning = idx.meta["k_factor_tuning"]
    assert not tuning["reached"] and [t["k_factor"] for t in tuning["ladder"]] == [1, 4, 16, 64]
    best = max(t["recall"] for t in tuning["ladder"])
    assert min(t["k_factor"] for t in tuning["ladder"] if t["recall"] >= best - 0.005) == tuning["k_factor"]
    assert "raise index.nprobe" in caplog.text


@pytest.mark.parametrize("override, named", [
    ("index.k_factors=[4, 2]", "index.k_factors: Value error, the k_factor ladder must be increasing"),
    ("index.k_factors=[0, 1]", "index.k_factors"),
    ("index.k_factors=[]", "index.k_factors"),
    ("index.target_recall=1.5", "index.target_recall"),
    ("index.target_recall=0", "index.target_recall"),
    ("index.refine=pq", "index.refine"),
])
def test_bad_refine_settings_are_refused_by_key(override, named):
    from xbn.config import ConfigError, load_params

    with pytest.raises(ConfigError, match=named.replace(".", r"\.").replace("[", r"\[")):
        load_params(None, [override])


def test_rows_appended_to_a_refined_ivf_pq_are_re_ranked_too():
    x = product_like(11_000, seed=3)
    idx = CatalogueIndex.build(x[:10_000], ids_for(10_000), IndexConfig(**PQ))
    assert idx.append(x[10_000:], ids_for(1000, start=10_000)) == 1000
    assert idx.index.refine_index.ntotal == idx.count == 11_000  # the fp16 store grows with the PQ lists
    scores, rows = idx.search(x[10_500:10_600], 1)
    assert (rows[:, 0] == np.arange(10_500, 10_600)).all()  # each new row finds itself, scored exactly
    np.testing.assert_allclose(scores[:, 0], 1.0, atol=2e-3)
