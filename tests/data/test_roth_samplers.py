"""Roth et al. 2020's batch samplers (xbn.data.samplers): SPC-R (b - 1 random images + one positive) and the
embedded greedy coreset, DDM and FRD (best of m random batches from the pool by default, greedy as an option)."""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import linalg
from scipy.stats import wasserstein_distance

from xbn.config import ConfigError, load_params
from xbn.data.samplers import SAMPLER_NAMES, build_batch_sampler
from xbn.data.samplers.ddm import best_distance_match, greedy_distance_match, histogram_wasserstein
from xbn.data.samplers.embedded import group_rows, pairwise_distances, random_group_batches
from xbn.data.samplers.frd import best_frechet_match, frechet_distance_to_pool, greedy_frechet_match
from xbn.data.samplers.greedy_coreset import k_center_greedy

EMBEDDED = ("greedy_coreset", "ddm", "frd")


def _config(name: str, **kw) -> SimpleNamespace:
    return SimpleNamespace(**{"name": name, "draw": "image", "candidates": 64, "selection": "best_of_m",
                              "candidate_batches": 10, "trials": 0, "projection_dim": 0, "bins": 20, **kw})


def _clustered(classes: int, per_class: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Labels and unit-norm embeddings: one Gaussian cluster per class, clusters of unequal spread."""
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(classes), per_class)
    centres = rng.normal(size=(classes, dim)) * rng.uniform(0.3, 2.0, size=(classes, 1))
    x = centres[labels] + 0.3 * rng.normal(size=(len(labels), dim))
    return labels, (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _sampler(name: str, labels, embeddings, seed=0, **kw):
    sampler = build_batch_sampler(_config(name, **kw), labels, 16, 4, seed=seed, batches_per_epoch=6)
    if hasattr(sampler, "fill"):
        sampler.fill(embeddings)
    return sampler


@pytest.mark.parametrize("name", SAMPLER_NAMES)
def test_batches_have_the_right_size_valid_indices_and_repeat_under_a_seed(name):
    labels, emb = _clustered(30, 6, 8)
    a, b = _sampler(name, labels, emb), _sampler(name, labels, emb)
    a.set_epoch(2)
    b.set_epoch(2)
    batches = list(a)
    assert len(batches) == len(a) == 6
    assert batches == list(b) == list(a)  # same (seed, epoch, bank): same batches
    for batch in batches:
        assert len(batch) == a.effective_batch_size == 16 and all(0 <= i < len(labels) for i in batch)
        if name == "spc_r":
            assert len(set(batch)) == 16
        else:  # SPC-n structure: 4 distinct classes x 4 distinct images
            assert sorted(Counter(labels[batch].tolist()).values()) == [4, 4, 4, 4] and len(set(batch)) == 16
    a.set_epoch(3)
    assert list(a) != batches
    assert list(_sampler(name, labels, emb, seed=1)) != list(_sampler(name, labels, emb, seed=0))


def test_spc_r_is_b_minus_1_random_images_plus_a_positive_of_one_of_them():
    labels = np.repeat(np.arange(200), 2)  # 400 images, pairs only: 15 random images rarely hold a pair
    sampler = build_batch_sampler(_config("spc_r"), labels, 16, 4, seed=3, batches_per_epoch=40)
    sampler.set_epoch(1)
    rng = np.random.default_rng([3, 1])  # the sampler's generator for (seed, epoch), replayed
    pairs_among_random = 0
    for batch in sampler:
        random_part, added = batch[:15], batch[15]
        # Exactly b - 1 uniform draws without replacement, then the added image's draws.
        assert random_part == rng.choice(400, size=15, replace=False).tolist()
        rng.integers(15), rng.integers(1)  # the member chosen, then its class's other image (one left)
        assert len(set(batch)) == 16 and added not in random_part
        assert labels[added] in set(labels[random_part].tolist())  # the batch's guaranteed positive pair
        pairs_among_random += len(set(labels[random_part].tolist())) < 15
    assert pairs_among_random < 40  # without the added image some batches would have had no positive pair


def test_spc_r_draws_images_uniformly_or_classes_uniformly():
    # One class of 90 images and 10 classes of 2: image-uniform draws take the big class 90/110 = 0.82 of the
    # time, class-uniform draws (Roth's code) 1/11 = 0.09.
    labels = np.concatenate([np.zeros(90, int), np.repeat(np.arange(1, 11), 2)])

    def big_share(draw: str) -> float:
        sampler = build_batch_sampler(_config("spc_r", draw=draw), labels, 8, 4, seed=0, batches_per_epoch=300)
        return float(np.mean([labels[b[:7]] == 0 for b in sampler]))

    assert big_share("image") == pytest.approx(90 / 110, abs=0.03)
    assert big_share("class") == pytest.approx(1 / 11, abs=0.03)


def test_spc_r_refuses_labels_without_any_pair():
    from xbn.data.errors import DatasetError

    with pytest.raises(DatasetError, match="at least 2 images"):
        build_batch_sampler(_config("spc_r"), np.arange(10), 4, 2, seed=0)


def _two_clusters() -> np.ndarray:
    """1-D pool of four groups of 2: A = {0, 1} twice, B = {5, 6} twice (groups 0, 1 in A; 2, 3 in B)."""
    return np.array([0, 1, 0, 1, 5, 6, 5, 6], dtype=np.float64)[:, None]


def test_ddm_best_of_m_keeps_the_candidate_whose_distance_histogram_is_closest():
    # Pool pair distances (28 pairs): 0 x4, 1 x8, 4 x4, 5 x8, 6 x4. Candidates of two groups: {A, A} and
    # {B, B} give 0 x2, 1 x4 (all short); {A, B} gives 1 x2, 4, 5 x2, 6, the pool's shape: it must win.
    # W1 by the CDFs' difference: {A, B}: 1/7 + 3 (3/7 - 1/3) + (4/7 - 1/2) + (6/7 - 5/6) = 11/21;
    # {A, A}: (1/3 - 1/7) + 3 (1 - 3/7) + 3/7 + 1/7 = 52/21. On bins of 0.1 every distance sits at its bin
    # centre (+0.05) except the 6s (last bin: 5.95), which moves W1 by at most 0.1 x 1/7.
    pool = _two_clusters()
    dist = pairwise_distances(pool)
    candidates = np.array([[0, 1], [2, 3], [0, 2]])
    assert best_distance_match(dist, 2, candidates, bins=60) == 2
    edges = np.linspace(0, 6, 61)
    target = np.histogram(dist[np.triu_indices(8, 1)], edges)[0]
    centres = (edges[:-1] + edges[1:]) / 2
    w1 = [wasserstein_distance(centres, centres, np.histogram(dist[np.ix_(r, r)][np.triu_indices(4, 1)],
                                                              edges)[0], target)
          for r in ([0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 4, 5])]
    np.testing.assert_allclose(w1, [52 / 21, 52 / 21, 11 / 21], atol=0.1 / 7 + 1e-9)


def test_frd_best_of_m_keeps_the_candidate_whose_gaussian_is_closest():
    # In 1-D the Frechet distance is (mu_p - mu_b)^2 + (sigma_p - sigma_b)^2 (sample variances): the pool has
    # mean 3, variance 52/7; {A, B} = {0, 1, 5, 6} mean 3, variance 26/3; {A, A} mean 0.5, variance 1/3.
    pool = _two_clusters()
    candidates = np.array([[0, 1], [2, 3], [0, 2]])
    assert best_frechet_match(pool, 2, candidates) == 2
    fd = frechet_distance_to_pool(pool, np.array([[0, 1, 4, 5], [0, 1, 2, 3]]))
    np.testing.assert_allclose(fd, [(math.sqrt(52 / 7) - math.sqrt(26 / 3)) ** 2,
                                    2.5 ** 2 + (math.sqrt(52 / 7) - math.sqrt(1 / 3)) ** 2], rtol=1e-5)


@pytest.mark.parametrize("name", ["ddm", "frd"])
def test_the_samplers_default_is_the_best_of_m_random_batches_from_the_pool(name):
    labels, emb = _clustered(30, 6, 8)
    sampler = _sampler(name, labels, emb, seed=4, candidate_batches=7)
    assert sampler.selection == "best_of_m" and load_params(None).train.sampler.selection == "best_of_m"
    rng = np.random.default_rng([4, 0])  # replay: the pool of b*/M groups, then m = 7 candidate batches
    for batch in sampler:
        pool = sampler._group_pool(rng)
        candidates = random_group_batches(len(pool), 4, 7, rng)
        assert candidates.shape == (7, 4) and all(len(set(c)) == 4 for c in candidates)
        features = sampler.features(pool.ravel())
        if name == "ddm":
            score = [wasserstein_to_pool(features, group_rows(c[None], 4)[0]) for c in candidates]
        else:
            score = frechet_distance_to_pool(features, group_rows(candidates, 4))
        assert batch == pool[candidates[int(np.argmin(score))]].ravel().tolist()


def wasserstein_to_pool(features: np.ndarray, rows: np.ndarray, bins: int = 20) -> float:
    """scipy's W1 between the distance histogram of `rows` and the pool's, on the pool's equal-width bins."""
    dist = pairwise_distances(features)
    upper = dist[np.triu_indices(len(dist), 1)]
    edges = np.linspace(upper.min(), upper.max(), bins + 1)
    centres = (edges[:-1] + edges[1:]) / 2
    sub = dist[np.ix_(rows, rows)][np.triu_indices(len(rows), 1)]
    return wasserstein_distance(centres, centres, np.histogram(sub, edges)[0], np.histogram(upper, edges)[0])


def test_k_center_greedy_picks_the_farthest_points():
    points = np.array([[0, 0], [1, 0], [10, 0], [0, 10], [5, 5], [0.5, 0.5]], dtype=float)
    # From (0,0): (10,0) at 10 (first of the ties); then (0,10) (10 from its nearest centre), then (5,5) (7.07).
    assert k_center_greedy(points, 4, first=0) == [0, 2, 3, 4]
    # (10,0) and (0,10) in one group: once (10,0) is taken its group is out, so (5,5) comes next.
    assert k_center_greedy(points, 3, first=0, groups=np.array([0, 1, 2, 2, 3, 4])) == [0, 2, 4]
    assert k_center_greedy(points, 9, first=1, groups=np.array([0, 0, 1, 1, 1, 0])) == [1, 3]  # groups run out


def test_histogram_wasserstein_equals_scipy():
    rng = np.random.default_rng(0)
    hists, target = rng.integers(0, 9, size=(4, 12)).astype(float), rng.integers(1, 9, size=12).astype(float)
    centres = 0.3 + 0.25 * (np.arange(12) + 0.5)
    expected = [wasserstein_distance(centres, centres, h, target) for h in hists]
    np.testing.assert_allclose(histogram_wasserstein(hists, target, 0.25), expected, rtol=1e-12)


def _pool(groups=48, m=4, dim=16):
    labels, emb = _clustered(groups, m, dim, seed=3)
    return emb.astype(np.float64)  # rows grouped by class: group g = rows g*m .. g*m+m-1


def test_ddm_batch_matches_the_pool_distance_histogram_better_than_random_batches():
    pool, m, k, bins = _pool(), 4, 8, 30
    dist = pairwise_distances(pool)
    upper = np.triu_indices(len(pool), 1)
    edges = np.linspace(dist[upper].min(), dist[upper].max(), bins + 1)
    centres = (edges[:-1] + edges[1:]) / 2
    target = np.histogram(dist[upper], edges)[0]

    def w1(groups) -> float:  # scipy's Wasserstein distance between the two distance histograms
        rows = (np.asarray(groups)[:, None] * m + np.arange(m)).ravel()
        sub = dist[np.ix_(rows, rows)][np.triu_indices(len(rows), 1)]
        return wasserstein_distance(centres, centres, np.histogram(sub, edges)[0], target)

    rng = np.random.default_rng(0)
    chosen = greedy_distance_match(dist, m, k, first=5, bins=bins)
    assert len(set(chosen)) == k and chosen[0] == 5
    random_w1 = [w1(rng.choice(len(pool) // m, k, replace=False)) for _ in range(200)]
    # Measured: greedy 0.0326, stochastic greedy (8 trials) 0.0478; 200 random batches: median 0.0909, best 0.0556.
    assert w1(chosen) < min(random_w1) and w1(chosen) < 0.5 * np.median(random_w1)
    stochastic = greedy_distance_match(dist, m, k, first=5, bins=bins, trials=8, rng=rng)
    assert w1(stochastic) < np.median(random_w1)


def _frechet(a: np.ndarray, b: np.ndarray) -> float:
    """The textbook Frechet distance of two Gaussian fits, with scipy's matrix square root."""
    ca, cb = np.cov(a.T), np.cov(b.T)
    return float(((a.mean(0) - b.mean(0)) ** 2).sum() + np.trace(ca) + np.trace(cb)
                 - 2 * np.trace(linalg.sqrtm(ca @ cb).real))


def test_frd_batch_is_closer_to_the_pool_gaussian_than_random_batches():
    pool, m, k = _pool(dim=6), 4, 8
    rng = np.random.default_rng(0)
    subsets = np.stack([rng.choice(len(pool), 32, replace=False) for _ in range(3)])
    expected = [_frechet(pool, pool[s]) for s in subsets]
    np.testing.assert_allclose(frechet_distance_to_pool(pool, subsets), expected, rtol=1e-5)  # sqrtm: ~1e-6

    def fd(groups) -> float:
        return _frechet(pool, pool[(np.asarray(groups)[:, None] * m + np.arange(m)).ravel()])

    chosen = greedy_frechet_match(pool, m, k, first=7)
    assert len(set(chosen)) == k and chosen[0] == 7
    random_fd = [fd(rng.choice(len(pool) // m, k, replace=False)) for _ in range(200)]
    # Measured: greedy 0.0428, stochastic greedy (8 trials) 0.0764; 200 random batches: median 0.2175, best 0.0805.
    assert fd(chosen) < min(random_fd) and fd(chosen) < 0.3 * np.median(random_fd)
    assert fd(greedy_frechet_match(pool, m, k, first=7, trials=8, rng=rng)) < np.median(random_fd)


def test_observe_refreshes_the_bank_and_steers_the_next_batches():
    labels = np.repeat(np.arange(10), 4)
    sampler = build_batch_sampler(_config("greedy_coreset", candidates=40), labels, 8, 4, seed=0,
                                  batches_per_epoch=5)
    with pytest.raises(RuntimeError, match="fill"):
        list(sampler)
    rng = np.random.default_rng(0)
    sampler.fill(0.01 * rng.normal(size=(40, 3)))
    far = 37  # class 9
    sampler.observe(torch.tensor([far, 2]), torch.tensor([[50.0, 0, 0], [0, 1.0, 0]], dtype=torch.bfloat16))
    np.testing.assert_array_equal(sampler.bank[[far, 2]], [[50, 0, 0], [0, 1, 0]])
    # A far-away image is the k-center's second anchor in every batch that does not start from its class.
    for batch in sampler:
        assert far in batch or 9 in set(labels[batch[:1]])

    restored = build_batch_sampler(_config("greedy_coreset", candidates=40), labels, 8, 4, seed=0,
                                   batches_per_epoch=5)
    restored.load_state_dict(sampler.state_dict())
    assert list(restored) == list(sampler)
    with pytest.raises(ValueError, match="one embedding per training image"):
        restored.fill(np.zeros((39, 3)))


def test_config_refuses_a_pool_smaller_than_the_batch(tiny_params):
    with pytest.raises(ConfigError, match="train.sampler.candidates"):
        tiny_params("train.sampler.name=ddm", "train.sampler.candidates=8")
    with pytest.raises(ConfigError, match="train.sampler.name"):
        tiny_params("train.sampler.name=coreset")


@pytest.mark.parametrize("name", EMBEDDED)
def test_training_with_an_embedded_sampler_runs_and_checkpoints_its_bank(tiny_params, name):
    from xbn.stages.prepare import prepare
    from xbn.training.trainer import Trainer

    params = tiny_params("memory.method=xbm", f"train.sampler.name={name}", "train.sampler.candidates=32",
                         "train.warmup_epochs=0", "train.epochs=1", "train.sampler.projection_dim=8")
    prepare(params)
    trainer = Trainer(params, progress=False)
    trainer._fill_bank()  # what fit() does first; kept to see the training stream refresh it
    initial = trainer.batches.bank.copy()
    summary = trainer.fit()
    assert summary["iterations"] == len(trainer.sampler) > 0
    bank = trainer.batches.bank
    assert bank.shape == initial.shape == (len(trainer._bank_source[1]), 16) and np.isfinite(bank).all()
    refreshed = (bank != initial).any(axis=1)
    assert refreshed.sum() >= trainer.batches.effective_batch_size  # rows the steps observed
    trainer.batches.load_state_dict({"bank": None})  # as a fresh process would start
    assert not trainer.batches.ready and trainer.resume() and trainer.batches.ready
    np.testing.assert_array_equal(trainer.batches.bank, bank)  # the bank travels in last.pt
