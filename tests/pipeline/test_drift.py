"""The drift report's statistics (issue 24 item 4): the MMD permutation test and the per-class shift, against
hand computations and known cases."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from xbn.stages.drift import _samples, class_shift, mmd_permutation_test


def test_mmd_is_the_unbiased_estimate_with_the_median_bandwidth():
    x = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    y = np.array([[2.0, 2.0], [3.0, 2.0]])
    z = np.concatenate([x, y])
    d2 = ((z[:, None] - z[None]) ** 2).sum(-1)
    h = np.median(d2[np.triu_indices(5, 1)])
    k = np.exp(-d2 / h)
    expected = ((k[:3, :3].sum() - 3) / 6 + (k[3:, 3:].sum() - 2) / 2 - 2 * k[:3, 3:].mean())
    observed, p = mmd_permutation_test(x, y, permutations=99, seed=0)
    assert observed == pytest.approx(expected, rel=1e-12)
    assert 0 < p <= 1


def test_the_permutation_test_separates_a_shift_from_noise():
    rng = np.random.default_rng(0)
    same = mmd_permutation_test(rng.normal(size=(60, 8)), rng.normal(size=(60, 8)), 199, seed=1)
    shifted = mmd_permutation_test(rng.normal(size=(60, 8)), rng.normal(size=(60, 8)) + 1.0, 199, seed=1)
    assert same[1] > 0.05 and shifted[1] == pytest.approx(1 / 200)  # no permutation beats a real shift


def test_class_shift_is_one_minus_the_centroid_cosine_largest_first():
    x = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    y = np.array([[0.0, 1.0], [0.0, 1.0], [1.0, 1.0]])
    shifts = class_shift(x, np.array(["a", "a", "b"]), y, np.array(["a", "b", "c"]))
    assert [s["class"] for s in shifts] == ["a", "b"]  # c is new: no centroid before
    assert shifts[0]["shift"] == pytest.approx(1.0) and shifts[1]["shift"] == pytest.approx(0.0)


def test_samples_split_unchanged_from_new_and_changed_images():
    before = pd.DataFrame({"path": ["a/1", "a/2", "b/1"], "label": ["a", "a", "b"], "md5": ["x", "y", "z"]})
    after = pd.DataFrame({"path": ["a/1", "a/2", "c/1"], "label": ["a", "a", "c"], "md5": ["x", "Y", "w"]})
    for frame in (before, after):
        frame["md5"] = frame["md5"].astype("string")
    old, new = _samples(before, after, size=10, seed=0)
    assert list(old["path"]) == ["a/1"] and list(new["path"]) == ["a/2", "c/1"]


def test_the_null_behind_the_p_value_is_what_the_drift_figure_draws(tmp_path):
    from xbn.stages.drift import mmd_null, p_value_of
    from xbn.tracking.plots import plot_drift

    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(40, 6)), rng.normal(size=(40, 6)) + 0.5
    observed, null = mmd_null(x, y, permutations=99, seed=2)
    assert len(null) == 99 and (observed, p_value_of(observed, null)) == mmd_permutation_test(x, y, 99, seed=2)
    png = plot_drift(observed, null, p_value_of(observed, null), 0.01, x, y, tmp_path / "drift.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
