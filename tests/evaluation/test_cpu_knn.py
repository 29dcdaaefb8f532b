"""The CPU search's two first passes (bf16, float32) give identical neighbours and metrics, near-ties included.

Both branches run on any CPU: `XBN_CPU_BF16` forces the choice (bf16 emulated where the CPU lacks it: slow, but
the same arithmetic bound holds, which `test_bf16_products_stay_within_the_bound` checks on this machine).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xbn.evaluation import knn_search, retrieval_metrics
from xbn.evaluation.cpu_knn import _slack, extra_candidates, norms
from xbn.utils.cpu import FORCE_ENV, bf16_gemm_is_fast

DIM = 32


@pytest.fixture(params=["0", "1"], ids=["float32", "bf16"])
def path(request, monkeypatch):
    monkeypatch.setenv(FORCE_ENV, request.param)
    assert bf16_gemm_is_fast() == (request.param == "1")
    return "bfloat16" if request.param == "1" else "float32"


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _exact(q: np.ndarray, r: np.ndarray, k: int, exclude: np.ndarray | None = None):
    """The definition: float64 dot rounded to float32, sorted by score, ties by the lower index."""
    s = (q.astype(np.float64) @ r.astype(np.float64).T).astype(np.float32)
    if exclude is not None:
        s[np.arange(len(q)), exclude] = -np.inf
    idx = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(s, idx, axis=1), idx


def near_ties(seed: int = 0) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Unit vectors (and labels) built to trip a bf16 first pass: exact duplicates, variants whose similarities
    differ by ~1e-5 (below bf16's resolution, above float32's), 40 copies straddling the k boundary of one
    query, and a query whose k-th and (k+1)-th neighbours differ by 1e-6. Returns the rows of interest too."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((300, DIM))
    labels = rng.integers(0, 60, 300)
    # variants of row 0..19: ten each, nudged by 1e-4 in one coordinate
    variants = np.repeat(base[:20], 10, axis=0)
    variants[np.arange(200), rng.integers(0, DIM, 200)] += 1e-4 * np.linalg.norm(base[0])
    var_labels = np.repeat(labels[:20], 10)
    dup_labels = rng.integers(0, 60, 40)
    # 40 exact copies of one vector close to query row 300 + 200 + 40 (the "crowd" query below)
    crowd_query = rng.standard_normal(DIM)
    crowd_copy = crowd_query + 0.3 * rng.standard_normal(DIM)
    crowd = np.repeat(crowd_copy[None], 40, axis=0)
    # a query q with neighbours at similarities s_1 > ... > s_8 and s_9 = s_8 - 1e-6
    q = _unit(rng.standard_normal((1, DIM)))[0].astype(np.float64)
    sims = np.array([0.9, 0.89, 0.88, 0.87, 0.86, 0.85, 0.84, 0.83, 0.83 - 1e-6])
    orth = rng.standard_normal((len(sims), DIM))
    orth -= np.outer(orth @ q, q)
    orth /= np.linalg.norm(orth, axis=1, keepdims=True)
    close = sims[:, None] * q + np.sqrt(1 - sims[:, None] ** 2) * orth
    x = np.concatenate([base, variants, crowd, crowd_query[None], q[None], close[::-1]])
    y = np.concatenate([labels, var_labels, dup_labels, [7, 8], [8] * 4 + [9] * 5])
    rows = {"crowd_query": 300 + 200 + 40, "gap_query": 300 + 200 + 40 + 1}
    return _unit(x), y, rows


def test_near_ties_leave_one_out_is_exact_and_the_fallbacks_run(path):
    x, _, rows = near_ties()
    k = 8
    stats: dict = {}
    sims, idx = knn_search(x, x, k, exclude_self=True, chunk_size=128, stats=stats)
    ref_sims, ref_idx = _exact(x, x, k, exclude=np.arange(len(x)))
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_array_equal(sims, ref_sims)
    assert stats["path"] == path and stats["queries"] == len(x)
    assert stats["candidates"] == k + extra_candidates(k, getattr(torch, path))
    # The crowd's 40 equal scores cross the k + m boundary: no candidate set certifies it, on either path.
    assert stats["exhaustive_queries"] >= 1
    if path == "bfloat16":  # the variants and the 1e-6 gap are below bf16's resolution
        assert stats["fallback_queries"] > stats["exhaustive_queries"]
    # the 1e-6 pair (rows -8 and -9) split at the k boundary by the exact score
    gap = rows["gap_query"]
    assert idx[gap, k - 1] == len(x) - 8 and len(x) - 9 not in idx[gap]
    assert sims[gap, k - 1] == pytest.approx(0.83, abs=1e-6)


def test_near_ties_query_to_reference_is_exact(path):
    x, _, _ = near_ties(seed=1)
    q = x[::3]
    stats: dict = {}
    sims, idx = knn_search(q, x, 12, chunk_size=100, stats=stats)
    ref_sims, ref_idx = _exact(q, x, 12)
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_array_equal(sims, ref_sims)
    # exclude: each query leaves out its own row, by index, as leave-one-out does
    own = np.arange(0, len(x), 3)
    sims, idx = knn_search(q, x, 12, chunk_size=100, exclude=own)
    np.testing.assert_array_equal(idx, _exact(q, x, 12, exclude=own)[1])


def test_paths_give_identical_metrics(monkeypatch, clustered):
    # The clustered set's metrics are not all 1.0; the near-tie rows ride along, labels and all.
    x, labels = clustered(n_classes=80, per_class=5, dim=DIM, noise=1.2, seed=3)
    t, t_labels, _ = near_ties(seed=2)
    x, labels = np.concatenate([x, t]), np.concatenate([labels, t_labels + 1000])
    results = []
    for force in ("0", "1"):
        monkeypatch.setenv(FORCE_ENV, force)
        loo = retrieval_metrics(x, labels, ks=(1, 4, 16), nmi=False, chunk_size=96)
        gallery = retrieval_metrics(x[::2], labels[::2], x[1::2], labels[1::2], ks=(1, 4, 16), nmi=False)
        results.append((loo, gallery))
    assert results[0] == results[1]
    assert 0.1 < results[0][0]["map@r"] < 0.9


def test_symmetric_and_cross_passes_agree(path):
    # Leave-one-out by the symmetric blocks equals query -> reference with exclude = own row.
    x, _, _ = near_ties(seed=3)
    loo = knn_search(x, x, 5, exclude_self=True, chunk_size=77)
    cross = knn_search(x, x.copy(), 5, exclude=np.arange(len(x)), chunk_size=64)
    np.testing.assert_array_equal(loo[1], cross[1])
    np.testing.assert_array_equal(loo[0], cross[0])


def test_every_reference_a_candidate(path):
    # k + m reaches the number of references: nothing is left out, so nothing needs certifying.
    x = _unit(np.random.default_rng(4).standard_normal((30, DIM)))
    stats: dict = {}
    sims, idx = knn_search(x, x, 21, exclude_self=True, stats=stats)
    np.testing.assert_array_equal(idx, _exact(x, x, 21, exclude=np.arange(30))[1])
    assert stats["candidates"] == 29 and stats["fallback_queries"] == 0


@pytest.mark.parametrize("kind", ["random", "rounded_down"])
def test_bf16_products_stay_within_the_bound(kind):
    # What the certificate trusts: torch's bf16 product (float32 accumulation, bf16 result) underestimates the
    # exact product by no more than the slack. "rounded_down": every component just above a bf16 number, with
    # the signs of q and r alike, so all rounding errors add up (near the worst case, ‖δq‖ ≈ u‖q‖).
    rng = np.random.default_rng(5)
    d = 512
    if kind == "random":
        q, r = _unit(rng.standard_normal((64, d))), _unit(rng.standard_normal((512, d)))
    else:
        signs = np.sign(rng.standard_normal(d))
        q, r = (signs * 2.0**-5 * (1 + 0.49 * 2.0**-7 * (1 + 0.01 * rng.random((n, d))))
                for n in (64, 512))
        q, r = q.astype(np.float32), r.astype(np.float32)
    c = (torch.from_numpy(q).bfloat16() @ torch.from_numpy(r).bfloat16().T).double().numpy()
    exact = q.astype(np.float64) @ r.astype(np.float64).T
    rel, abs_ = _slack(torch.bfloat16, norms(q), norms(r).max(axis=0), d)
    used = (exact - c) / (rel * np.abs(c) + abs_[:, None])
    assert used.max() < 1
    if kind == "rounded_down":  # the bound is not loose where the errors are near their worst
        assert used.min() > 0.3
