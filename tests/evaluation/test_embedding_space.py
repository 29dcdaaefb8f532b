"""Roth et al. 2020's embedding-space metrics against hand computations and brute force."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.spatial.distance import cdist

from xbn.evaluation.embedding_space import (
    clustering_f1,
    embedding_space_metrics,
    map_at_k,
    pi_metrics,
    singular_values,
    spectral_decay,
    spectrum_rows,
)


def unit(deg):
    return np.array([math.cos(math.radians(deg)), math.sin(math.radians(deg))])


def test_isotropic_spectrum_has_zero_decay():
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.standard_normal((6, 6)))  # orthonormal rows: every singular value is 1
    x = np.vstack([q, -q]).astype(np.float32)  # 12 points, the same energy in every direction
    np.testing.assert_allclose(singular_values(x), np.full(6, math.sqrt(2)), rtol=1e-5)
    assert spectral_decay(singular_values(x)) == pytest.approx(0.0, abs=1e-9)


def test_spectral_decay_matches_a_hand_computation():
    # Singular values 3, 2, 1 -> S = (1/2, 1/3, 1/6); KL(U || S) = 1/3 [ln(2/3) + ln(1) + ln(2)] = ln(4/3)/3.
    x = np.diag([3.0, 2.0, 1.0]).astype(np.float32)
    np.testing.assert_allclose(singular_values(x), [3.0, 2.0, 1.0], rtol=1e-6)
    assert spectral_decay(singular_values(x)) == pytest.approx(math.log(4 / 3) / 3, rel=1e-6)
    # Leaving the largest out (Roth's rho_spectrum@2): 10, 3, 2, 1 -> the same 3, 2, 1.
    assert spectral_decay(np.array([10.0, 3.0, 2.0, 1.0]), skip=1) == pytest.approx(math.log(4 / 3) / 3)


def test_reported_rho_leaves_out_the_largest_singular_value():
    # Roth et al. footnote 3: rows 10 e1, 3 e2, 2 e3, 1 e4 have singular values 10, 3, 2, 1; without the 10,
    # S = (1/2, 1/3, 1/6) and rho = ln(4/3)/3 = 0.0959 (with it: S = (10, 3, 2, 1)/16, rho = 0.3627).
    from xbn.config import load_params

    x = np.diag([10.0, 3.0, 2.0, 1.0]).astype(np.float32)
    labels = np.array([0, 0, 1, 1])
    values, spectrum = embedding_space_metrics(x, labels, x, labels)
    np.testing.assert_allclose(spectrum, [10.0, 3.0, 2.0, 1.0], rtol=1e-6)
    assert values["rho_spectrum"] == pytest.approx(math.log(4 / 3) / 3, rel=1e-6)
    full = 0.25 * sum(math.log(0.25 / (s / 16)) for s in (10, 3, 2, 1))
    assert spectral_decay(spectrum) == pytest.approx(full, rel=1e-6) and full == pytest.approx(0.3627, abs=1e-4)
    assert load_params(None).eval.spectrum_skip == 1  # what `xbn evaluate` passes


def test_singular_values_match_numpy_svd_in_chunks():
    x = np.random.default_rng(1).standard_normal((300, 16)).astype(np.float32)
    np.testing.assert_allclose(singular_values(x, chunk_size=64), np.linalg.svd(x, compute_uv=False), rtol=1e-4)


def test_pi_metrics_on_a_hand_made_example():
    # Class 0 at 0 and 90 degrees (cosine distance 1), class 1 twice at 180 degrees (0), class 2 alone at
    # 270 degrees (no pair: out of pi_intra). pi_intra = (1 + 0) / 2.
    # Centres at 45, 180, 270 degrees: distances 1 - cos 135 (twice) and 1 - cos 90, averaged.
    x = np.stack([unit(0), unit(90), unit(180), unit(180), unit(270)])
    out = pi_metrics(x, ["a", "a", "b", "b", "c"])
    inter = (2 * (1 + math.sqrt(0.5)) + 1) / 3
    assert out["pi_intra"] == pytest.approx(0.5, abs=1e-6)
    assert out["pi_inter"] == pytest.approx(inter, abs=1e-6)
    assert out["pi_ratio"] == pytest.approx(0.5 / inter, abs=1e-6)


def test_pi_metrics_match_pairwise_cosine_distances(clustered):
    x, labels = clustered(n_classes=12, per_class=5, dim=8, noise=0.8, seed=2)
    per_class, centres = [], []
    for c in np.unique(labels):
        rows = x[labels == c]
        centres.append(rows.mean(0) / np.linalg.norm(rows.mean(0)))
        if len(rows) > 1:
            d = cdist(rows, rows, "cosine")
            per_class.append(d.sum() / (len(rows) ** 2 - len(rows)))
    d = cdist(np.array(centres), np.array(centres), "cosine")
    out = pi_metrics(x, labels)
    assert out["pi_intra"] == pytest.approx(np.mean(per_class), abs=1e-5)
    assert out["pi_inter"] == pytest.approx(d.sum() / (len(d) ** 2 - len(d)), abs=1e-5)


def test_f1_is_one_for_perfectly_separated_clusters():
    rng = np.random.default_rng(3)
    centres = 10 * np.eye(5, 8)
    labels = np.repeat(np.arange(5), 6)
    x = (centres[labels] + 0.01 * rng.standard_normal((30, 8))).astype(np.float32)
    assert clustering_f1(x, labels) == pytest.approx(1.0)


def test_f1_counts_pairs_as_hand_computed():
    # Two far-apart blobs (k-means finds them): blob P holds labels 0, 0, 0, 1 and blob Q labels 1, 1.
    # Same-class pairs: 3 + 3 = 6; same-cluster pairs: 6 + 1 = 7; both: 3 (class 0 in P) + 1 (in Q) = 4.
    # F1 = 2 TP / (same-class + same-cluster) = 8 / 13.
    rng = np.random.default_rng(4)
    x = np.vstack([[10.0, 0.0]] * 4 + [[-10.0, 0.0]] * 2) + 0.01 * rng.standard_normal((6, 2))
    assert clustering_f1(x.astype(np.float32), [0, 0, 0, 1, 1, 1]) == pytest.approx(8 / 13)


def brute_force_map(q, q_labels, r, r_labels, k, leave_one_out):
    aps = []
    for i in range(len(q)):
        sims = r @ q[i]
        order = [j for j in np.argsort(-sims, kind="stable") if not (leave_one_out and j == i)][:k]
        relevant = sum(r_labels[j] == q_labels[i] for j in range(len(r)) if not (leave_one_out and j == i))
        if relevant == 0:
            continue
        hits, ap = 0, 0.0
        for rank, j in enumerate(order, start=1):
            if r_labels[j] == q_labels[i]:
                hits += 1
                ap += hits / rank
        aps.append(ap / min(k, relevant))
    return float(np.mean(aps))


@pytest.mark.parametrize("k", [5, 1000])
def test_map_at_k_matches_brute_force_leave_one_out(clustered, k):
    x, labels = clustered(n_classes=20, per_class=5, dim=8, noise=1.0, seed=5)
    expected = brute_force_map(x, labels, x, labels, k, leave_one_out=True)
    assert map_at_k(x, labels, k=k, chunk_size=37) == pytest.approx(expected, rel=1e-9)


def test_map_at_k_matches_brute_force_query_to_gallery(clustered):
    x, labels = clustered(n_classes=15, per_class=6, dim=8, noise=1.0, seed=6)
    q, ql, r, rl = x[::3], labels[::3], np.delete(x, np.s_[::3], 0), np.delete(labels, np.s_[::3])
    expected = brute_force_map(q, ql, r, rl, 1000, leave_one_out=False)
    assert map_at_k(q, ql, r, rl) == pytest.approx(expected, rel=1e-9)


def test_perfect_ranking_scores_one():
    x = (10 * np.eye(4, 6))[np.repeat(np.arange(4), 3)].astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    assert map_at_k(x, np.repeat(np.arange(4), 3)) == pytest.approx(1.0)


def test_embedding_space_metrics_bundle(clustered):
    train, train_labels = clustered(n_classes=10, per_class=5, dim=8, noise=0.5, seed=7)
    test, test_labels = clustered(n_classes=8, per_class=5, dim=8, noise=0.5, seed=8)
    values, spectrum = embedding_space_metrics(train, train_labels, test, test_labels)
    assert set(values) == {"rho_spectrum", "pi_intra", "pi_inter", "pi_ratio", "f1", "map@1000"}
    assert values["rho_spectrum"] == pytest.approx(spectral_decay(singular_values(train), skip=1))
    rows = spectrum_rows(spectrum)
    assert [r["index"] for r in rows] == list(range(1, 9))
    assert sum(r["normalized"] for r in rows) == pytest.approx(1.0)
    assert all(a["singular_value"] >= b["singular_value"] for a, b in zip(rows, rows[1:]))
