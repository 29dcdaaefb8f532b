"""retrieval_metrics against a per-query brute force, a hand computation and pytorch-metric-learning."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

from xbn.evaluation import retrieval_metrics

KS = (1, 2, 4, 8, 10, 100)
KNN_KEYS = [f"recall@{k}" for k in KS] + ["map@r", "r_precision"]


def _brute_force(q, q_labels, r=None, r_labels=None, ks=KS) -> dict[str, float]:
    """One query at a time from the full float64 similarity matrix, straight from the definitions."""
    per_query, skipped = _brute_force_per_query(q, q_labels, r, r_labels, ks)
    out = {key: float(np.mean(values)) for key, values in per_query.items()}
    out["queries_without_match"] = skipped
    return out


def _brute_force_per_query(q, q_labels, r=None, r_labels=None, ks=KS) -> tuple[dict[str, list[float]], int]:
    leave_one_out = r is None
    if leave_one_out:
        r, r_labels = q, q_labels
    sims = q.astype(np.float64) @ r.astype(np.float64).T
    per_query: dict[str, list[float]] = {key: [] for key in KNN_KEYS}
    skipped = 0
    for i in range(len(q)):
        order = np.argsort(-sims[i], kind="stable")
        if leave_one_out:
            order = order[order != i]
        correct = r_labels[order] == q_labels[i]
        big_r = int(correct.sum())
        if big_r == 0:
            skipped += 1
            continue
        for k in ks:
            per_query[f"recall@{k}"].append(float(correct[:k].any()))
        precisions = [correct[: j + 1].sum() / (j + 1) for j in range(big_r) if correct[j]]
        per_query["map@r"].append(sum(precisions) / big_r)
        per_query["r_precision"].append(correct[:big_r].sum() / big_r)
    return per_query, skipped


def _assert_knn_metrics_equal(got: dict, expected: dict) -> None:
    for key in [*KNN_KEYS, "queries_without_match"]:
        assert got[key] == pytest.approx(expected[key], abs=1e-12), key


def test_leave_one_out_matches_brute_force(clustered_with_ties):
    x, labels = clustered_with_ties
    got = retrieval_metrics(x, labels, nmi=False)
    expected = _brute_force(x, labels)
    _assert_knn_metrics_equal(got, expected)
    # The data must exercise the metrics, not saturate them.
    assert 0.2 < got["map@r"] < got["recall@1"] < got["recall@10"] < 1.0
    assert got["num_queries"] == got["num_references"] == len(x)
    assert got["queries_without_match"] >= 1  # the label seen once, and single-image classes


def test_query_to_gallery_matches_brute_force(clustered_with_ties):
    x, labels = clustered_with_ties
    gallery = np.arange(len(x)) % 3 != 0
    q, q_labels = x[~gallery], labels[~gallery]
    q_labels[0] = -5  # a query whose label the gallery lacks
    got = retrieval_metrics(q, q_labels, x[gallery], labels[gallery], nmi=False)
    _assert_knn_metrics_equal(got, _brute_force(q, q_labels, x[gallery], labels[gallery]))
    assert (got["num_queries"], got["num_references"]) == (len(q), gallery.sum())


@pytest.mark.parametrize("protocol", ["leave-one-out", "query-gallery"])
def test_per_query_scores_are_the_values_the_metrics_average(clustered_with_ties, protocol):
    x, labels = clustered_with_ties
    if protocol == "leave-one-out":
        args = (x, labels)
    else:
        gallery = np.arange(len(x)) % 3 != 0
        args = (x[~gallery], labels[~gallery], x[gallery], labels[gallery])
    metrics, scores = retrieval_metrics(*args, nmi=False, chunk_size=37, per_query=True)
    expected, skipped = _brute_force_per_query(*args)
    assert scores.evaluated.dtype == bool and len(scores.evaluated) == len(args[0])
    assert (~scores.evaluated).sum() == skipped == metrics["queries_without_match"]
    for key in KNN_KEYS:
        assert scores.scores[key] == pytest.approx(expected[key], abs=1e-12), key
        assert scores.scores[key].mean() == pytest.approx(metrics[key], abs=1e-12), key
    assert set(np.unique(scores.scores["recall@1"])) <= {0.0, 1.0}
    assert retrieval_metrics(*args, nmi=False, chunk_size=37) == metrics  # the flag changes nothing else


def test_hand_computed_example():
    # Unit vectors on a circle at these angles; similarity falls with the angle between them.
    angles = np.deg2rad([0, 12, 20, 35, 100])
    x = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    labels = np.array(["a", "a", "b", "a", "c"])  # b and c are seen once: no match in leave-one-out
    got = retrieval_metrics(x, labels, ks=(1, 2), nmi=False)
    # Neighbours: 0 -> 1(a) 2(b) 3(a); 1 -> 2(b) 0(a) 3(a); 3 -> 2(b) 1(a) 0(a); R = 2 for each.
    # AP@R: query 0 hits rank 1 -> 1/2; queries 1 and 3 hit rank 2 only -> (1/2)/2 = 1/4.
    assert got == {
        "recall@1": pytest.approx(1 / 3),
        "recall@2": 1.0,
        "map@r": pytest.approx((1 / 2 + 1 / 4 + 1 / 4) / 3),
        "r_precision": pytest.approx(1 / 2),
        "num_queries": 5,
        "num_references": 5,
        "queries_without_match": 2,
    }


@pytest.mark.parametrize("gallery_split", [False, True])
def test_agrees_with_pytorch_metric_learning(clustered, gallery_split):
    x, labels = clustered(n_classes=60, per_class=5, dim=32, noise=1.3, seed=3)
    calculator = AccuracyCalculator(
        include=("precision_at_1", "r_precision", "mean_average_precision_at_r", "NMI"),
        k="max_bin_count",
        device=torch.device("cpu"),
    )
    if gallery_split:
        gallery = np.arange(len(x)) % 2 == 0
        args = (x[~gallery], labels[~gallery], x[gallery], labels[gallery])
    else:
        args = (x, labels)
    expected = calculator.get_accuracy(*args)
    # PML's FaissKMeans runs faiss.Kmeans with its default seed, 1234.
    got = retrieval_metrics(*args, seed=1234)
    assert got["map@r"] == pytest.approx(expected["mean_average_precision_at_r"], abs=1e-6)
    assert got["r_precision"] == pytest.approx(expected["r_precision"], abs=1e-6)
    assert got["recall@1"] == pytest.approx(expected["precision_at_1"], abs=1e-6)
    assert got["nmi"] == pytest.approx(expected["NMI"], abs=1e-6)
    assert 0.1 < got["map@r"] < 0.9 and 0.1 < got["nmi"] < 1.0


@pytest.mark.parametrize("chunk_size", [1, 13])
def test_chunking_does_not_change_the_metrics(clustered_with_ties, chunk_size):
    x, labels = clustered_with_ties
    whole = retrieval_metrics(x, labels, nmi=False)
    assert retrieval_metrics(x, labels, chunk_size=chunk_size, nmi=False) == pytest.approx(whole, abs=1e-12)


def test_torch_tensors_and_string_labels_give_the_same_metrics(clustered_with_ties):
    x, labels = clustered_with_ties
    expected = retrieval_metrics(x, labels, nmi=False)
    got = retrieval_metrics(torch.from_numpy(x), np.array([f"class-{v}" for v in labels]), nmi=False)
    assert got == pytest.approx(expected, abs=1e-12)
    assert retrieval_metrics(x, torch.from_numpy(labels), nmi=False) == pytest.approx(expected, abs=1e-12)


def test_nmi_is_deterministic_for_a_seed(clustered_with_ties):
    x, labels = clustered_with_ties
    first = retrieval_metrics(x, labels, seed=7)["nmi"]
    assert retrieval_metrics(x, labels, seed=7)["nmi"] == first
    assert 0.5 < first < 1.0


def test_no_query_with_a_match_gives_nan_metrics():
    x = np.eye(4, dtype=np.float32)
    got = retrieval_metrics(x[:2], [0, 1], x[2:], [2, 3], ks=(1,), nmi=False)
    assert math.isnan(got["recall@1"]) and math.isnan(got["map@r"]) and math.isnan(got["r_precision"])
    assert got["queries_without_match"] == 2


def test_label_with_a_single_image_is_left_out(clustered):
    x, labels = clustered(n_classes=20, per_class=4, dim=8, noise=1.0, seed=9)
    lone = np.full((1, 8), 8**-0.5, np.float32)
    with_lone = retrieval_metrics(np.concatenate([x, lone]), np.append(labels, 1000), nmi=False)
    without = retrieval_metrics(x, labels, nmi=False)
    # The lone image is still a (wrong) neighbour of others, so only its own row is left out.
    assert with_lone["queries_without_match"] == without["queries_without_match"] + 1
    _assert_knn_metrics_equal(with_lone, _brute_force(np.concatenate([x, lone]), np.append(labels, 1000)))


_X5, _Y5 = np.zeros((5, 4)), np.arange(5)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((_X5, [0, 1, 2]), {}, "query_labels has 3 entries but query_emb has 5 rows"),
        ((_X5, np.zeros((5, 2))), {}, "query_labels must be 1-D"),
        ((_X5, _Y5, np.zeros((6, 3)), np.arange(6)), {}, "dimension 3 but query_emb has 4"),
        ((_X5, _Y5, np.zeros((6, 4)), _Y5), {}, "reference_labels has 5 entries but reference_emb has 6"),
        ((_X5, _Y5, np.zeros((6, 4))), {}, "pass both reference_emb and reference_labels"),
        ((_X5, _Y5), {"ks": ()}, "ks must be a non-empty"),
        ((_X5, _Y5), {"ks": (1, 0)}, "ks must be a non-empty"),
    ],
)
def test_bad_inputs_raise_clear_errors(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        retrieval_metrics(*args, nmi=False, **kwargs)
