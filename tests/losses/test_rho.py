"""rho-regularization (Roth et al. 2020 Sec. 5): a mined negative becomes another positive of its anchor with
probability p_switch, for triplet and pair tuples, seeded, with its generator in state_dict."""

from __future__ import annotations

import pytest
import torch
from pytorch_metric_learning import miners
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
from torch import nn

from xbn.config import load_params
from xbn.losses.miners import RandomTripletMiner
from xbn.losses.rho import RhoRegularizedMiner
from xbn.training.criterion import build_criterion


def batch(n_classes=16, per_class=4, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = nn.functional.normalize(torch.randn(n_classes * per_class, dim, generator=g), dim=1)
    return x, torch.arange(n_classes).repeat_interleave(per_class)


def all_pairs_miner():
    return miners.PairMarginMiner(pos_margin=0.0, neg_margin=10.0)  # every pair lies within these margins


def test_p_switch_one_writes_every_triplet_as_anchor_anchor_other_positive():
    x, y = batch()
    a, _, _ = lmu.get_all_triplets_indices(y)
    a2, p2, n2 = RhoRegularizedMiner(None, 1.0, seed=0)(x, y)  # no miner: around all triplets
    assert torch.equal(a2, a) and torch.equal(p2, a)  # (a, a, p'), as Roth's reference code
    assert (y[n2] == y[a]).all() and (n2 != a).all()  # p': another sample of the anchor's class


def test_a_switched_triplet_only_pushes_the_other_positive_away():
    # 1-D, class 0 at 0 and 0.2, class 1 at 3; triplets (0, 1, 2) and (1, 0, 2), margin 0.5. Switched as
    # (a, a, p'): (0, 0, 1) and (1, 1, 0), each [0 - 0.2 + 0.5]+ = 0.3, so the loss is 0.3 and its gradient
    # moves 0 and 0.2 apart (d/dx0 = +1, d/dx1 = -1 after averaging the two). Written (a, p, p') the triplet
    # (0, 1, 1) is [d - d + 0.5]+ = 0.5 whatever the points: the push cancels (gradient 0).
    from pytorch_metric_learning.distances import LpDistance
    from pytorch_metric_learning.losses import TripletMarginLoss

    x = torch.tensor([[0.0], [0.2], [3.0]], requires_grad=True)
    y = torch.tensor([0, 0, 1])
    loss_fn = TripletMarginLoss(margin=0.5, distance=LpDistance(normalize_embeddings=False))
    tuples = RhoRegularizedMiner(None, 1.0, seed=0)(x, y)
    assert sorted(zip(*(t.tolist() for t in tuples))) == [(0, 0, 1), (1, 1, 0)]
    loss = loss_fn(x, y, tuples)
    loss.backward()
    assert loss.item() == pytest.approx(0.3)
    torch.testing.assert_close(x.grad, torch.tensor([[1.0], [-1.0], [0.0]]))
    x.grad = None
    cancelled = loss_fn(x, y, (torch.tensor([0, 1]), torch.tensor([1, 0]), torch.tensor([1, 0])))
    cancelled.backward()
    assert cancelled.item() == pytest.approx(0.5) and x.grad.abs().sum() == 0


def test_p_switch_zero_leaves_the_miner_output_unchanged():
    x, y = batch()
    expected = RandomTripletMiner(seed=5)(x, y)
    wrapped = RhoRegularizedMiner(RandomTripletMiner(seed=5), 0.0, seed=0)
    out = wrapped(x, y)
    assert all(torch.equal(o, e) for o, e in zip(out, expected))
    assert wrapped.last_switched == 0


def test_p_switch_switches_that_fraction_of_the_triplets():
    x, y = batch()  # 16 classes x 4: 64 anchors x 3 positives x 60 negatives = 11520 triplets
    rho = RhoRegularizedMiner(None, 0.3, seed=1)
    a, p, n = rho(x, y)
    switched = y[n] == y[a]
    assert len(a) == 11520
    assert int(switched.sum()) == rho.last_switched
    assert abs(switched.double().mean().item() - 0.3) < 0.015  # 3.5 sigma of a binomial(11520, 0.3)
    _, p_all, n_all = lmu.get_all_triplets_indices(y)
    assert torch.equal(n[~switched], n_all[~switched]) and torch.equal(p[~switched], p_all[~switched])
    assert torch.equal(p[switched], a[switched])  # the switched ones are (a, a, p')


def test_pairs_switch_one_negative_pair_per_anchor():
    x, y = batch(n_classes=4)
    a1, p, a2, n = all_pairs_miner()(x, y)
    rho = RhoRegularizedMiner(all_pairs_miner(), 1.0, seed=2)
    out = rho(x, y)
    assert torch.equal(out[2], a2) and len(out[3]) == len(n)  # the same negative slots
    changed = out[3] != n
    assert (y[out[3][changed]] == y[a2[changed]]).all() and (out[3] != a2).all()  # (a2, p'): same class
    # p = 1: exactly one switched pair for each of the 16 anchors, the rest untouched (Roth: one per anchor).
    assert torch.equal(torch.sort(a2[changed]).values, torch.arange(16)) and rho.last_switched == 16


def test_pairs_switch_anchors_at_rate_p():
    x, y = batch()  # 64 anchors, each with 60 negative pairs
    rho = RhoRegularizedMiner(all_pairs_miner(), 0.3, seed=7)
    counts = [(rho(x, y), rho.last_switched)[1] for _ in range(50)]
    assert abs(sum(counts) / (50 * 64) - 0.3) < 0.03  # 3.5 sigma of a binomial(3200, 0.3)


def test_an_anchor_with_a_single_positive_switches_to_it():
    # Class 0 has two samples: the only other positive of anchor 0 is 1, so (0, 1, n) becomes (0, 0, 1).
    y = torch.tensor([0, 0, 1, 1, 1, 2])
    x = nn.functional.normalize(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)), dim=1)
    a, p, n = RhoRegularizedMiner(None, 1.0)(x, y)
    single = y[a] == 0
    assert torch.equal(n[single], 1 - a[single]) and torch.equal(p, a)
    assert (y[n] == y[a]).all() and (n != a).all()


def test_against_a_memory_the_switched_positive_is_never_the_anchor_own_row():
    # PML's CrossBatchMemory drops (a, own row): against a memory the triplet is (a, p, p'), p' != p.
    old, old_y = batch(seed=1)
    x, y = batch(n_classes=8, per_class=2, seed=2)
    ref, ref_y = torch.cat([old, x]), torch.cat([old_y, y])
    a, p, n = RhoRegularizedMiner(RandomTripletMiner(num_triplets=500), 1.0)(x, y, ref, ref_y)
    assert (ref_y[n] == y[a]).all() and (n != a + len(old)).all() and (n != p).all()
    assert (p != a + len(old)).all()  # the miner's positive is kept


def test_seeded_and_resumed_from_state_dict():
    x, y = batch()
    first = RhoRegularizedMiner(None, 0.5, seed=3)
    assert torch.equal(first(x, y)[2], RhoRegularizedMiner(None, 0.5, seed=3)(x, y)[2])
    state = first.state_dict()
    expected = first(x, y)[2]
    resumed = RhoRegularizedMiner(None, 0.5, seed=0)
    resumed.load_state_dict(state)
    assert torch.equal(resumed(x, y)[2], expected)


def test_refuses_tuples_that_are_neither_triplets_nor_pairs():
    class PairsOnly(nn.Module):
        def forward(self, embeddings, labels, ref_emb=None, ref_labels=None):
            return torch.tensor([0]), torch.tensor([1])

    x, y = batch(n_classes=2)
    with pytest.raises(ValueError, match="triplets or"):
        RhoRegularizedMiner(PairsOnly(), 0.5)(x, y)
    with pytest.raises(ValueError, match="p_switch"):
        RhoRegularizedMiner(None, 1.5)


def test_build_criterion_wraps_the_configured_miner_and_trains_through_a_memory():
    params = load_params(None, ["memory.method=xbm", "memory.size=128", "model.embedding_dim=8",
                                "loss.name=TripletMarginLoss", "loss.params={margin: 0.2}",
                                "loss.miner=SoftHardMiner", "loss.miner_params={}", "loss.rho.p_switch=0.4"])
    crit = build_criterion(params, num_train_images=1000)
    assert isinstance(crit.miner, RhoRegularizedMiner) and crit.memory.miner is crit.miner
    x, y = batch()
    x.requires_grad_(True)
    loss = crit(x, y)
    loss.backward()
    assert torch.isfinite(loss) and x.grad.abs().sum() > 0
    assert crit.miner.last_switched > 0
    assert any(k.endswith("miner._extra_state") for k in crit.state_dict())
    plain = build_criterion(load_params(None, ["memory.method=none"]), num_train_images=1000)
    assert type(plain.miner).__name__ == "PairMarginMiner"  # p_switch 0 (the default): no wrapper


def test_for_a_pair_loss_a_switched_pair_is_negative_only():
    # SupCon (a pair loss) with triplets from a miner: PML would assert on a pair that is both positive and
    # negative, which a switched (a, p') is whenever (a, p') is also a mined positive pair.
    x, y = batch(n_classes=4)
    rho = RhoRegularizedMiner(None, 1.0, seed=4, pairs=True)
    a1, p, a2, n = rho(x, y)
    positive, negative = set(zip(a1.tolist(), p.tolist())), set(zip(a2.tolist(), n.tolist()))
    assert not positive & negative
    switched = {(a, b) for a, b in negative if y[a] == y[b]}
    assert len(switched) == rho.last_switched == 16  # one per anchor at p = 1
    all_a1, all_p, _, _ = lmu.get_all_pairs_indices(y)
    assert positive == set(zip(all_a1.tolist(), all_p.tolist())) - switched  # only the switched ones left


@pytest.mark.parametrize("miner", [["loss.miner=PairMarginMiner"],
                                   ["loss.miner=DistanceWeightedMiner", "loss.miner_params={cutoff: 0.5}"]])
def test_the_default_pair_loss_trains_with_rho_through_a_memory(miner):
    params = load_params(None, ["memory.method=axbn", "memory.size=128", "model.embedding_dim=8",
                                "loss.rho.p_switch=0.5", *miner])
    crit = build_criterion(params, num_train_images=1000)
    assert crit.miner.pairs  # SupConLoss is a pair loss
    for seed in range(3):  # the memory fills, so switched pairs reach into it
        x, y = batch(seed=seed)
        x.requires_grad_(True)
        loss = crit(x, y)
        loss.backward()
        assert torch.isfinite(loss)
    assert crit.miner.last_switched > 0
