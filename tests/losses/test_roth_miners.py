"""The four batch miners of Roth et al. 2020 by name: ours (random, soft-hard) and PML's (semi-hard,
distance-weighted). Selection rules are checked against hand-worked 1-D examples."""

from __future__ import annotations

import pytest
import torch
from pytorch_metric_learning.distances import LpDistance

from xbn.losses import build_miner
from xbn.losses.miners import RandomTripletMiner, SoftHardMiner

ROTH_MINERS = [
    ("RandomTripletMiner", {}),
    ("SoftHardMiner", {}),
    ("TripletMarginMiner", {"type_of_triplets": "semihard", "margin": 0.2}),
    ("DistanceWeightedMiner", {"cutoff": 0.5, "nonzero_loss_cutoff": 1.4}),
]

# Points on a line (A..F = 0..5), classes A B F: 0, C D: 1, E: 2 (a singleton: never an anchor).
LINE = torch.tensor([[0.0], [1.0], [1.3], [3.0], [0.6], [-0.3]])
LINE_LABELS = torch.tensor([0, 0, 1, 1, 2, 0])
RAW = {"distance": LpDistance(normalize_embeddings=False)}  # 1-D points must not be normalized to +-1


def batch(n_classes=8, per_class=4, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.normalize(torch.randn(n_classes * per_class, dim, generator=g), dim=1)
    return x, torch.arange(n_classes).repeat_interleave(per_class)


def triplets_of(miner, *args):
    return [tuple(t) for t in torch.stack(miner(*args), 1).tolist()]


@pytest.mark.parametrize(("name", "params"), ROTH_MINERS)
def test_every_miner_returns_valid_triplets(name, params):
    x, y = batch()
    a, p, n = build_miner(name, params)(x, y)
    assert len(a) > 0
    assert (a != p).all()
    assert (y[a] == y[p]).all()
    assert (y[a] != y[n]).all()


@pytest.mark.parametrize("name", ["RandomTripletMiner", "SoftHardMiner"])
def test_against_a_memory_the_anchor_own_row_is_never_its_positive(name):
    # As in a cross-batch memory: the batch is already enqueued among older rows.
    old, old_y = batch(seed=1)
    x, y = batch(n_classes=8, per_class=2, seed=2)
    ref, ref_y = torch.cat([old, x]), torch.cat([old_y, y])
    own = torch.arange(len(x)) + len(old)
    for _ in range(5):
        a, p, n = build_miner(name)(x, y, ref, ref_y)
        assert (p != own[a]).all()
        assert (y[a] == ref_y[p]).all() and (y[a] != ref_y[n]).all()


def test_semihard_is_pml_triplet_margin_miner_and_keeps_exactly_the_semihard_triplets():
    # By hand, margin 0.5: (a, p, n) with 0 < d(a,n) - d(a,p) <= 0.5. A,B,C: 1.3 - 1 = 0.3; A,F,E: 0.6 - 0.3;
    # F,B,C: 1.6 - 1.3; D,C,B: 2 - 1.7. Every other triplet is hard (<= 0) or easy (> 0.5).
    miner = build_miner("TripletMarginMiner", {"type_of_triplets": "semihard", "margin": 0.5, **RAW})
    assert sorted(triplets_of(miner, LINE, LINE_LABELS)) == [(0, 1, 2), (0, 5, 4), (3, 2, 1), (5, 1, 2)]


def test_softhard_picks_hard_positives_and_negatives_else_any():
    # By hand (Roth's rule): hard positive = farther than the closest negative, hard negative = closer than
    # the farthest positive. A: pos B 1, F 0.3; closest neg E 0.6 -> B; farthest pos 1 -> E only.
    # F: pos A 0.3, B 1.3; closest neg E 0.9 -> B; farthest pos 1.3 -> E only.
    # B: pos A 1, F 1.3 both beyond C 0.3; negs closer than 1.3: C 0.3, E 0.4.
    # C: pos D 1.7; every negative (A 1.3, B 0.3, E 0.7, F 1.6) is closer than 1.7.
    # D: pos C 1.7 is closer than every negative (>= 2): no hard positive, no hard negative -> any.
    miner = build_miner("SoftHardMiner", {**RAW, "seed": 3})
    seen: dict[int, set] = {i: set() for i in range(6)}
    for _ in range(200):
        a, p, n = miner(LINE, LINE_LABELS)
        assert a.tolist() == [0, 1, 2, 3, 5]
        for ai, pi, ni in zip(a.tolist(), p.tolist(), n.tolist()):
            seen[ai].add((pi, ni))
    positives = {k: {pn[0] for pn in v} for k, v in seen.items()}
    negatives = {k: {pn[1] for pn in v} for k, v in seen.items()}
    assert seen[0] == {(1, 4)} and seen[5] == {(1, 4)}
    assert positives[1] == {0, 5} and negatives[1] == {2, 4}
    assert positives[2] == {3} and negatives[2] == {0, 1, 4, 5}
    assert positives[3] == {2} and negatives[3] == {0, 1, 4, 5}


def test_random_miner_with_num_triplets_is_uniform_over_triplets():
    # Roth's reference code: `num_triplets` drawn from all valid triplets. Labels 0,0,0,1,1,2: each class-0 anchor has 2 x 3 triplets, each class-1 anchor 1 x 4, class 2 none,
    # so anchors are drawn with probability 6/26 and 4/26; positives and negatives uniformly within.
    labels = torch.tensor([0, 0, 0, 1, 1, 2])
    x = torch.nn.functional.normalize(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), dim=1)
    a, p, n = RandomTripletMiner(num_triplets=8000, seed=1)(x, labels)
    freq = torch.bincount(a, minlength=6).double() / len(a)
    expected = torch.tensor([6, 6, 6, 4, 4, 0], dtype=torch.float64) / 26
    torch.testing.assert_close(freq, expected, atol=0.02, rtol=0)  # ~4 sigma
    from_0 = a == 0  # positives 1, 2 and negatives 3, 4, 5 equally often
    torch.testing.assert_close(torch.bincount(p[from_0], minlength=3)[1:].double() / from_0.sum(),
                               torch.tensor([0.5, 0.5], dtype=torch.float64), atol=0.04, rtol=0)
    torch.testing.assert_close(torch.bincount(n[from_0], minlength=6)[3:].double() / from_0.sum(),
                               torch.full((3,), 1 / 3, dtype=torch.float64), atol=0.04, rtol=0)


def test_random_miner_draws_one_triplet_per_anchor():
    # Labels 0,0,0,1,1,2: rows 0-4 have a positive and a negative, row 5 (class 2 alone) has no positive.
    # Each of rows 0-4 is the anchor of exactly one triplet per call; anchor 0's positive is 1 or 2 and its
    # negative 3, 4 or 5, each equally likely.
    labels = torch.tensor([0, 0, 0, 1, 1, 2])
    x = torch.nn.functional.normalize(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), dim=1)
    miner = RandomTripletMiner(seed=2)
    pos, neg = [], []
    for _ in range(3000):
        a, p, n = miner(x, labels)
        assert a.tolist() == [0, 1, 2, 3, 4]
        assert (labels[p] == labels[a]).all() and (p != a).all() and (labels[n] != labels[a]).all()
        pos.append(int(p[0]))
        neg.append(int(n[0]))
    torch.testing.assert_close(torch.bincount(torch.tensor(pos), minlength=3)[1:].double() / 3000,
                               torch.tensor([0.5, 0.5], dtype=torch.float64), atol=0.03, rtol=0)
    torch.testing.assert_close(torch.bincount(torch.tensor(neg), minlength=6)[3:].double() / 3000,
                               torch.full((3,), 1 / 3, dtype=torch.float64), atol=0.03, rtol=0)
    # Against a memory: still one triplet per batch row, the positives and negatives from the memory.
    old, old_y = batch(seed=1)
    xb, yb = batch(n_classes=8, per_class=2, seed=2)
    a, p, n = RandomTripletMiner(seed=0)(xb, yb, torch.cat([old, xb]), torch.cat([old_y, yb]))
    assert a.tolist() == list(range(16))


@pytest.mark.parametrize("cls", [RandomTripletMiner, SoftHardMiner])
def test_seeded_and_the_generator_state_resumes_from_state_dict(cls):
    x, y = batch()
    first, second = cls(seed=7), cls(seed=7)
    assert triplets_of(first, x, y) == triplets_of(second, x, y)
    state = first.state_dict()
    expected = triplets_of(first, x, y)
    resumed = cls(seed=0)
    resumed.load_state_dict(state)
    assert triplets_of(resumed, x, y) == expected


def test_no_valid_triplet_gives_empty_tuples():
    x, y = batch(n_classes=4, per_class=1)  # all singletons: no positive anywhere
    for miner in (RandomTripletMiner(), SoftHardMiner()):
        assert all(len(t) == 0 for t in miner(x, y))


def test_unknown_miner_lists_pml_and_ours():
    with pytest.raises(ValueError) as err:
        build_miner("SemiHard")
    assert "TripletMarginMiner" in str(err.value) and "SoftHardMiner" in str(err.value)
    assert "RandomTripletMiner" in str(err.value)
