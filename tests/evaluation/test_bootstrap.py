"""The paired bootstrap on hand cases: no difference, a clear one, one within noise; reproducibility; and its
properties at sizes nobody picked (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xbn.evaluation import bootstrap
from xbn.evaluation.bootstrap import paired_bootstrap


def test_identical_hits_give_zero_and_a_zero_width_interval():
    hits = np.random.default_rng(0).integers(0, 2, 200).astype(bool)
    assert paired_bootstrap(hits, hits) == (0.0, 0.0, 0.0)
    # A lower bound of 0 does not exceed a minimum improvement of 0: no promotion on a tie.
    assert not paired_bootstrap(hits, hits).low > 0.0


def test_thirty_more_hits_in_a_hundred_is_clearly_better():
    champion = np.zeros(100)
    champion[:50] = 1  # right on 50 queries
    challenger = champion.copy()
    challenger[50:80] = 1  # right on 30 more
    difference, low, high = paired_bootstrap(challenger, champion, resamples=2000, seed=0)
    assert difference == pytest.approx(0.30)
    # Each query's difference is 0 or 1 (30 of them): the mean's standard error is sqrt(.3*.7/100) ~ 0.046.
    assert 0.15 < low < difference < high < 0.45


def test_a_tiny_difference_on_few_queries_is_within_noise():
    champion = np.array([1, 0, 1, 1, 0, 1, 0, 1, 1, 0])
    challenger = champion.copy()
    challenger[1] = 1  # one more hit of ten
    difference, low, high = paired_bootstrap(challenger, champion, seed=3)
    assert difference == pytest.approx(0.1)
    assert low <= 0.0 <= high  # the interval contains 0: not evidence of an improvement
    worse = paired_bootstrap(champion, challenger, seed=3)
    assert worse.difference == pytest.approx(-0.1) and worse.low <= 0.0 <= worse.high


def test_the_interval_is_reproducible_for_a_seed_and_varies_with_it():
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 2, 300), rng.integers(0, 2, 300)
    assert paired_bootstrap(a, b, seed=7) == paired_bootstrap(a, b, seed=7)
    assert paired_bootstrap(a, b, seed=7) != paired_bootstrap(a, b, seed=8)
    # The percentile interval widens with the confidence.
    narrow, wide = paired_bootstrap(a, b, confidence=0.8), paired_bootstrap(a, b, confidence=0.99)
    assert wide.low < narrow.low and narrow.high < wide.high


def test_the_interval_is_the_percentile_interval_of_the_resampled_means(monkeypatch):
    # Hand-checkable: draw the same index matrix and compute the quantiles directly; also through small blocks
    # of resamples (the memory bound for large n), which must not change the stream of draws.
    rng = np.random.default_rng(2)
    a, b = rng.random(50), rng.random(50)
    idx = np.random.default_rng(5).integers(0, 50, size=(1000, 50))
    means = (a - b)[idx].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    assert paired_bootstrap(a, b, seed=5) == pytest.approx(((a - b).mean(), low, high), abs=1e-15)
    monkeypatch.setattr(bootstrap, "_BLOCK_ELEMENTS", 50 * 64)  # 64 resamples per block
    assert paired_bootstrap(a, b, seed=5) == pytest.approx(((a - b).mean(), low, high), abs=1e-15)


@pytest.mark.parametrize("kwargs, match", [
    ({"a": [1, 0], "b": [1]}, "same queries"),
    ({"a": [], "b": []}, "no queries"),
    ({"a": [1.0, np.nan], "b": [1, 0]}, "NaN"),
    ({"a": [1, 0], "b": [1, 0], "resamples": 0}, "resamples"),
    ({"a": [1, 0], "b": [1, 0], "confidence": 1.0}, "confidence"),
])
def test_bad_input_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        paired_bootstrap(**kwargs)


def test_the_interval_is_the_percentiles_of_the_resampled_means_the_gate_draws():
    from xbn.evaluation.bootstrap import bootstrap_means

    rng = np.random.default_rng(3)
    a, b = rng.random(300) < 0.7, rng.random(300) < 0.6
    diff, means = bootstrap_means(a, b, resamples=500, seed=4)
    assert len(means) == 500 and diff.mean() == pytest.approx(a.mean() - b.mean())
    got = paired_bootstrap(a, b, resamples=500, confidence=0.9, seed=4)
    assert (got.low, got.high) == tuple(np.quantile(means, [0.05, 0.95]))


scores = st.lists(st.floats(0, 1, allow_nan=False), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(a=scores, shift=st.floats(-1, 1, allow_nan=False), seed=st.integers(0, 2**16),
       confidence=st.floats(0.5, 0.99))
def test_properties_of_the_paired_interval(a, shift, seed, confidence):
    """Whatever the scores: the interval holds the observed difference's resampled range (low <= high, both
    within the per-query differences' min and max); swapping the models mirrors it exactly; a constant shift of
    every query's score moves all three by that shift (the pairing cancels the queries' own difficulty)."""
    a = np.array(a)
    b = np.random.default_rng(seed).random(len(a))
    d, low, high = paired_bootstrap(a, b, resamples=200, confidence=confidence, seed=seed)
    diff = a - b
    assert diff.min() - 1e-12 <= low <= high <= diff.max() + 1e-12
    mirrored = paired_bootstrap(b, a, resamples=200, confidence=confidence, seed=seed)
    assert mirrored == pytest.approx((-d, -high, -low), abs=1e-12)
    shifted = paired_bootstrap(a + shift, b, resamples=200, confidence=confidence, seed=seed)
    assert shifted == pytest.approx((d + shift, low + shift, high + shift), abs=1e-9)
