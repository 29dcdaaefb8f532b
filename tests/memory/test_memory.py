"""The memory's equations, checked with numbers (seed 000: Eq. 6, Eq. 18-23, Appendix C)."""

import math

import pytest
import torch
from pytorch_metric_learning import losses, miners

from xbn.config import load_params
from xbn.memory import CrossBatchMemory
from xbn.training.criterion import Criterion, build_criterion, memory_rows
from xbn.memory.moments import BatchMoments, EMAMoments, KalmanMoments

D = 8


def unit(n, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=g) * 0.3 + 0.2, dim=1)


def labels(n, per_class=4, offset=0):
    return torch.arange(n) // per_class + offset


def make_memory(moments, size=100, miner=True):
    return CrossBatchMemory(losses.SupConLoss(), D, size,
                                    miner=miners.PairMarginMiner(0.2, 0.8) if miner else None, moments=moments)


def feed(memory, steps, batch=16, seed=0):
    out = []
    for s in range(steps):
        x = unit(batch, seed=seed + s) * (1 + 0.1 * s)  # drifting scale, like a network in training
        out.append(memory(x.requires_grad_(), labels(batch, offset=s * 10)))
    return out


def test_xbn_maps_old_rows_to_exact_batch_moments():
    memory = make_memory(BatchMoments())
    feed(memory, 3)  # 48 rows stored
    old = memory.num_valid
    batch = unit(16, seed=99) * 3 + 1
    memory(batch, labels(16, offset=500))
    rows = memory.embedding_memory[:old].double()
    torch.testing.assert_close(rows.mean(0), batch.double().mean(0), atol=1e-6, rtol=0)
    torch.testing.assert_close(rows.std(0, unbiased=False), batch.double().std(0, unbiased=False),
                               atol=1e-6, rtol=0)
    # and the batch itself is stored as it came
    torch.testing.assert_close(memory.embedding_memory[old:old + 16], batch)


def test_xbn_equation_6_rowwise():
    memory = make_memory(BatchMoments())
    feed(memory, 2)
    before = memory.valid_rows().clone().double()
    batch = unit(16, seed=7) * 2
    memory(batch, labels(16, offset=700))
    b = batch.double()
    expected = (before - before.mean(0)) / before.std(0, unbiased=False) * b.std(0, unbiased=False) + b.mean(0)
    torch.testing.assert_close(memory.embedding_memory[: len(before)].double(), expected, atol=1e-5, rtol=0)


def test_running_sums_match_exact_moments_through_wraparound():
    memory = make_memory(KalmanMoments(D, p0=1.0, q=1e-3, r=0.5), size=40)
    memory.refresh_interval = 1000  # rely on the incremental bookkeeping alone
    feed(memory, 9, batch=12)  # wraps the 40-row ring several times
    mean, std = memory.memory_moments()
    rows = memory.valid_rows().double()
    torch.testing.assert_close(mean, rows.mean(0), atol=1e-6, rtol=0)
    torch.testing.assert_close(std, rows.std(0, unbiased=False), atol=1e-6, rtol=0)


def test_axbn_with_zero_measurement_noise_equals_xbn():
    xbn, axbn = make_memory(BatchMoments()), make_memory(KalmanMoments(D, p0=1.0, q=0.1, r=0.0))
    lx, la = feed(xbn, 6), feed(axbn, 6)
    torch.testing.assert_close(axbn.embedding_memory, xbn.embedding_memory, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.stack(la), torch.stack(lx), atol=1e-6, rtol=0)


def test_axbn_with_constant_gain_equals_ema():
    # Started at its steady-state covariance P* (P*^2 + qP* - qR = 0), the filter's gain never changes,
    # so AXBN is an EMA with momentum K* = (P* + q) / (P* + q + R).
    q, r, batch = 0.01, 0.5, 16
    R = r / batch
    p_star = (-q + math.sqrt(q * q + 4 * q * R)) / 2
    k_star = (p_star + q) / (p_star + q + R)
    axbn = make_memory(KalmanMoments(D, p0=p_star, q=q, r=r))
    ema = make_memory(EMAMoments(D, momentum=1 - k_star))
    feed(axbn, 6, batch=batch), feed(ema, 6, batch=batch)
    torch.testing.assert_close(axbn.moments.gain, torch.full((D,), k_star, dtype=torch.float64))
    torch.testing.assert_close(axbn.embedding_memory, ema.embedding_memory, atol=1e-6, rtol=0)


@pytest.mark.parametrize("interval", [1, 3])
def test_kalman_gain_sequence_matches_hand_computation(interval):
    p0, q, r, batch = 2.0, 0.05, 4.0, 16
    kf = KalmanMoments(1, p0=p0, q=q, r=r, gain_interval=interval)
    P, K, expected = p0, None, []
    for step in range(10):
        if step % interval == 0:
            prior = P + q
            K = prior / (prior + r / batch)
            P = (1 - K) * prior
        expected.append(K)
    got = []
    z = torch.zeros(1, dtype=torch.float64)
    for _ in range(10):
        kf(z, z + 1, z, z + 1, batch)
        got.append(float(kf.gain))
    assert got == pytest.approx(expected, rel=1e-12)
    assert expected[0] == pytest.approx((p0 + q) / (p0 + q + r / batch))


def test_kalman_estimate_is_the_recursive_average_of_observations():
    kf = KalmanMoments(1, p0=1.0, q=0.0, r=1.0)
    prior = torch.tensor([10.0], dtype=torch.float64)
    obs = [1.0, 2.0, 3.0, 4.0]
    x, P = 10.0, 1.0
    for y in obs:
        K = P / (P + 1.0)
        x, P = x + K * (y - x), (1 - K) * P
        mean, _ = kf(prior, prior, torch.tensor([y], dtype=torch.float64), prior, 1)
    assert float(mean) == pytest.approx(x)
    # With q = 0 and prior weight 1/p0 the estimate is the average of the prior and all observations.
    assert x == pytest.approx((10 + sum(obs)) / 5)


def test_state_dict_round_trip_gives_identical_next_loss():
    torch.manual_seed(0)
    a = make_memory(KalmanMoments(D, p0=1.0, q=1e-2, r=1.0), size=50)
    feed(a, 5, batch=12)
    state = a.state_dict()
    assert state["_extra_state"]["queue_idx"] == a.queue_idx and state["_extra_state"]["has_been_filled"]
    b = make_memory(KalmanMoments(D, p0=1.0, q=1e-2, r=1.0), size=50)
    b.load_state_dict(state)
    x, y = unit(12, seed=123), labels(12, offset=900)
    torch.testing.assert_close(b(x, y), a(x, y), atol=0, rtol=0)
    torch.testing.assert_close(b.embedding_memory, a.embedding_memory, atol=0, rtol=0)


def test_zero_std_and_single_row_never_divide_by_zero():
    memory = make_memory(BatchMoments(), size=64, miner=False)
    one = torch.full((1, D), 0.25)
    memory.add_to_memory(one, torch.tensor([0]), 1)  # a memory of one row: sigma[R] = 0 everywhere
    batch = unit(16, seed=3)
    memory(batch, labels(16, offset=10))
    row = memory.embedding_memory[0]
    assert torch.isfinite(memory.embedding_memory).all()
    torch.testing.assert_close(row, batch.mean(0), atol=1e-6, rtol=0)


def test_criterion_without_memory_is_the_plain_mined_loss():
    params = load_params(None, ["memory.method=none", "model.embedding_dim=8"])
    crit = build_criterion(params, num_train_images=100)
    x, y = unit(16, seed=5), labels(16)
    plain = losses.SupConLoss(temperature=0.1)(x, y, miners.PairMarginMiner(0.2, 0.8)(x, y))
    torch.testing.assert_close(crit(x, y), plain)


def test_criterion_start_iteration_and_xbm_star():
    loss, miner = losses.SupConLoss(), miners.PairMarginMiner(0.2, 0.8)
    memory = CrossBatchMemory(loss, D, 64, miner=miner)
    crit = Criterion(loss, miner, memory, start_iteration=1, add_batch_loss=True)
    x0, x1 = unit(16, seed=1), unit(16, seed=2)
    torch.testing.assert_close(crit(x0, labels(16)), crit.batch_loss(x0, labels(16)))
    assert memory.num_valid == 0  # the memory is untouched before start_iteration
    reference = CrossBatchMemory(loss, D, 64, miner=miner)
    expected = reference(x1, labels(16, offset=50)) + crit.batch_loss(x1, labels(16, offset=50))
    torch.testing.assert_close(crit(x1, labels(16, offset=50)), expected)


@pytest.mark.parametrize("start, warmup, first", [("after_warmup", 2, 10), ("after_warmup", 0, 0), (3, 2, 15),
                                                  (0, 2, 0)])
def test_memory_starts_after_the_head_warmup_by_default(start, warmup, first):
    # Seed 000 Sec. 5.1: the head pre-warm-up is plain SupCon on the minibatch; the memory joins after it.
    params = load_params(None, [f"memory.start={start}", f"train.warmup_epochs={warmup}", "model.embedding_dim=8"])
    crit = build_criterion(params, num_train_images=100, steps_per_epoch=5)
    assert crit.start_iteration == first
    for _ in range(first):
        crit(unit(16), labels(16))
    assert crit.memory.num_valid == 0
    crit(unit(16), labels(16))
    assert crit.memory.num_valid == 16


def test_ema_momentum_follows_the_papers_convention():
    # App. C: estimate <- m * estimate + (1 - m) * batch. m = 0 is XBN; m = 0.1 moves 90% of the way.
    xbn, ema0 = make_memory(BatchMoments()), make_memory(EMAMoments(D, momentum=0.0))
    feed(xbn, 5), feed(ema0, 5)
    torch.testing.assert_close(ema0.embedding_memory, xbn.embedding_memory, atol=1e-6, rtol=0)
    ema = EMAMoments(2, momentum=0.1)
    zero, one = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    ema(zero, zero, zero, zero, 16)  # the first call takes the memory's own moments as the estimate
    mean, _ = ema(zero, zero, one, one, 16)
    torch.testing.assert_close(mean, torch.full((2,), 0.9, dtype=torch.float64))
    with pytest.raises(Exception, match="ema_momentum"):
        load_params(None, ["memory.ema_momentum=1.0"])
    assert load_params(None, ["memory.ema_momentum=0"]).memory.ema_momentum == 0.0


def test_memory_rows_fraction_or_count():
    assert memory_rows(0.5, 1000, 64) == 500
    assert memory_rows(1.0, 1000, 64) == 1000
    assert memory_rows(4096, 1000, 64) == 4096
    assert memory_rows(0.01, 1000, 64) == 64


@pytest.mark.parametrize("moments", [None, BatchMoments()])
def test_diagnostics_are_the_moments_the_update_saw(moments):
    # Reduced only when read (the trainer reads them every train.log_every steps), from what the update kept.
    memory = make_memory(moments, size=64, miner=False)
    feed(memory, 2)
    before = memory.valid_rows().double().clone()
    batch = unit(16, seed=11) * 2
    memory.add_to_memory(batch, labels(16, offset=300), 16)
    got = {k: float(v) for k, v in memory.last_diagnostics.items()}
    # The memory's moments come from the running sums, which follow each map exactly while the stored rows are
    # float32: they differ by the rows' rounding (~1e-8 here).
    assert got["memory_mean"] == pytest.approx(float(before.mean()), abs=1e-7)
    assert got["memory_std"] == pytest.approx(float(before.std(0, unbiased=False).mean()), abs=1e-7)
    if moments is None:
        assert set(got) == {"memory_mean", "memory_std"}
        return
    b = batch.double()
    scale = b.std(0, unbiased=False) / before.std(0, unbiased=False)
    assert got["batch_mean"] == pytest.approx(float(b.mean()), abs=1e-9)
    assert got["batch_std"] == pytest.approx(float(b.std(0, unbiased=False).mean()), abs=1e-9)
    assert got["scale"] == pytest.approx(float(scale.mean()), abs=1e-7) and got["gain"] == 1.0


def test_refreshed_sums_over_several_blocks_equal_a_direct_reduction():
    from xbn.memory.cross_batch import REFRESH_BLOCK

    memory = make_memory(BatchMoments(), size=2 * REFRESH_BLOCK + 88, miner=False)
    rows = unit(memory.memory_size, seed=4) * 3 + 0.5
    memory.add_to_memory(rows, labels(len(rows)), len(rows))
    memory.row_sum.fill_(7.0)  # whatever the running sums drifted to
    memory.refresh_sums()
    r = rows.double()
    torch.testing.assert_close(memory.row_sum, r.sum(0), rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(memory.row_sq_sum, (r * r).sum(0), rtol=1e-12, atol=1e-10)
