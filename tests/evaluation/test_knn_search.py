"""knn_search against a float64 brute-force search, and its edge cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xbn.evaluation import knn_search
from xbn.evaluation.knn import _torch_search_fn


def _unit(n: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _brute_force(q: np.ndarray, r: np.ndarray, k: int, exclude_self: bool = False):
    sims = q.astype(np.float64) @ r.astype(np.float64).T
    if exclude_self:
        np.fill_diagonal(sims, -np.inf)
    idx = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(sims, idx, axis=1), idx


@pytest.mark.parametrize("exclude_self", [False, True])
def test_matches_brute_force(exclude_self):
    r = _unit(300, 24, seed=0)
    q = r if exclude_self else _unit(70, 24, seed=1)
    sims, idx = knn_search(q, r, 10, exclude_self=exclude_self)
    ref_sims, ref_idx = _brute_force(q, r, 10, exclude_self)
    assert sims.dtype == np.float32 and idx.dtype == np.int64 and idx.shape == (len(q), 10)
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_allclose(sims, ref_sims, atol=1e-6)


@pytest.mark.parametrize("block", [16, 50, 128, 299])
def test_leave_one_out_by_symmetric_blocks_matches_brute_force(block):
    # Blocks above the diagonal serve their rows and their columns; the last block is ragged and, at 16,
    # narrower than k, so rows start with an unfilled top-k.
    x = _unit(300, 24, seed=5)
    sims, idx = knn_search(x, x, 25, exclude_self=True, chunk_size=block)
    ref_sims, ref_idx = _brute_force(x, x, 25, exclude_self=True)
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_allclose(sims, ref_sims, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_chunking_does_not_change_the_result(chunk_size):
    x = _unit(200, 16, seed=2)
    whole = knn_search(x, x, 12, exclude_self=True, chunk_size=4096)
    chunked = knn_search(x, x, 12, exclude_self=True, chunk_size=chunk_size)
    np.testing.assert_array_equal(chunked[1], whole[1])
    np.testing.assert_allclose(chunked[0], whole[0], atol=1e-6)


def test_exclude_self_removes_the_query_not_its_duplicates():
    x = _unit(50, 8, seed=3)
    x[[10, 11, 12]] = x[10]  # three identical embeddings: similarity ties with the query itself
    sims, idx = knn_search(x, x, 3, exclude_self=True, chunk_size=16)
    assert not (idx == np.arange(50)[:, None]).any()
    for i, twins in [(10, {11, 12}), (11, {10, 12}), (12, {10, 11})]:
        assert set(idx[i, :2]) == twins
        np.testing.assert_allclose(sims[i, :2], 1.0, atol=1e-6)


def test_exclude_self_with_more_duplicates_than_k():
    # Six copies, k=2: faiss may return three copies other than the query; one must still be dropped.
    x = _unit(30, 8, seed=4)
    x[:6] = x[0]
    sims, idx = knn_search(x, x, 2, exclude_self=True)
    assert idx.shape == (30, 2)
    for i in range(6):
        assert i not in idx[i] and set(idx[i]) <= set(range(6)) and len(set(idx[i])) == 2
    np.testing.assert_allclose(sims[:6], 1.0, atol=1e-6)


def test_k_is_clamped_to_the_number_of_references():
    x = _unit(20, 8, seed=5)
    assert knn_search(x[:5], x, 100)[1].shape == (5, 20)
    sims, idx = knn_search(x, x, 100, exclude_self=True)
    assert idx.shape == (20, 19)
    assert all(set(row) == set(range(20)) - {i} for i, row in enumerate(idx))
    assert knn_search(x[:1], x[:1], 5, exclude_self=True)[1].shape == (1, 0)


def test_torch_tensors_are_accepted():
    x = _unit(60, 8, seed=6)
    expected = knn_search(x, x, 5, exclude_self=True)
    t = torch.from_numpy(x).double().requires_grad_()
    got = knn_search(t, t, 5, exclude_self=True)
    np.testing.assert_array_equal(got[1], expected[1])
    np.testing.assert_allclose(got[0], expected[0], atol=1e-6)


def test_torch_matmul_path_matches_faiss():
    # The GPU fallback (matmul + topk) is device-generic: checked here on the CPU.
    q, r = _unit(40, 16, seed=7), _unit(150, 16, seed=8)
    sims, idx = _torch_search_fn(r, 9, "cpu")(q)
    ref_sims, ref_idx = _brute_force(q, r, 9)
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_allclose(sims, ref_sims, atol=1e-6)


@pytest.mark.parametrize(
    ("queries", "references", "kwargs", "message"),
    [
        (np.zeros((4, 8)), np.zeros((9, 6)), {}, "queries have dimension 8 but references have 6"),
        (np.zeros(8), np.zeros((9, 8)), {}, "queries must be a 2-D"),
        (np.zeros((4, 8)), np.zeros((0, 8)), {}, "references is empty"),
        (np.zeros((4, 8)), np.ones((4, 8)), {"exclude_self": True}, "must be the same set"),
        (np.full((4, 8), np.nan), np.zeros((4, 8)), {}, "queries contains NaN"),
        (np.zeros((4, 8)), np.zeros((4, 8)), {"chunk_size": 0}, "chunk_size must be positive"),
    ],
)
def test_bad_inputs_raise_clear_errors(queries, references, kwargs, message):
    with pytest.raises(ValueError, match=message):
        knn_search(queries, references, 3, **kwargs)


@pytest.mark.parametrize("k", [0, -1, 2.5, True])
def test_k_must_be_a_positive_integer(k):
    with pytest.raises(ValueError, match="k must be a positive integer"):
        knn_search(np.zeros((3, 4)), np.zeros((3, 4)), k)
