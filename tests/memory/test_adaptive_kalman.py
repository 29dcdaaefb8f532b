"""axbn_auto: the noise-adaptive filter tracks known drifting statistics better than a fixed-gain EMA and XBN."""

import math

import pytest
import torch

from xbn.memory.moments import AdaptiveKalmanMoments, BatchMoments, EMAMoments

DIM, BATCH, STEPS, BURN_IN = 512, 64, 500, 50


def stream(kind: str, seed: int = 0):
    """Minibatches from N(mu_t, sd_t^2) per dimension, with the true (mu_t, sd_t) alongside."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.zeros(DIM, dtype=torch.float64)
    sd = torch.full((DIM,), 0.05, dtype=torch.float64)
    for t in range(STEPS):
        if kind == "step" and t == STEPS // 2:  # a sudden shift, e.g. a learning-rate change
            mu, sd = mu + 0.05, sd * 2
        elif kind == "sine":  # smooth, sustained drift
            mu = torch.full((DIM,), 0.03 * math.sin(t / 40), dtype=torch.float64)
            sd = torch.full((DIM,), 0.05 * (1 + 0.3 * math.sin(t / 55)), dtype=torch.float64)
        x = mu + sd * torch.randn(BATCH, DIM, generator=g, dtype=torch.float64)
        yield mu, sd, x.mean(0), x.std(0, unbiased=False)


def tracking_error(estimator, kind: str) -> tuple[float, float]:
    """RMS error of the estimated mean and std against the truth, after a burn-in."""
    sq_mean = sq_std = 0.0
    for t, (mu, sd, batch_mean, batch_std) in enumerate(stream(kind)):
        mean, std = estimator(batch_mean, batch_std, batch_mean, batch_std, BATCH)
        if t >= BURN_IN:
            sq_mean += float(((mean - mu) ** 2).mean())
            sq_std += float(((std - sd) ** 2).mean())
    n = STEPS - BURN_IN
    return math.sqrt(sq_mean / n), math.sqrt(sq_std / n)


@pytest.mark.parametrize("kind", ["static", "step", "sine"])
def test_auto_beats_fixed_gain_ema_and_xbn(kind):
    auto = tracking_error(AdaptiveKalmanMoments(DIM), kind)
    ema = tracking_error(EMAMoments(DIM, momentum=0.9), kind)  # a gain of 0.1
    xbn = tracking_error(BatchMoments(), kind)
    print(f"{kind}: mean/std RMS error auto {auto[0]:.2e}/{auto[1]:.2e}  ema {ema[0]:.2e}/{ema[1]:.2e}  "
          f"xbn {xbn[0]:.2e}/{xbn[1]:.2e}")
    assert auto[0] < ema[0] and auto[1] < ema[1]
    assert auto[0] < xbn[0] and auto[1] < xbn[1]


def test_gain_falls_without_drift_and_rises_after_a_shift():
    filt = AdaptiveKalmanMoments(DIM)
    gains = []
    for mu, sd, m, s in stream("step"):
        filt(m, s, m, s, BATCH)
        gains.append(float(filt.gain.mean()))
    before_shift = gains[STEPS // 2 - 1]
    assert before_shift < 0.05  # nearly the 1/k averaging of a static filter
    assert max(gains[STEPS // 2: STEPS // 2 + 20]) > 5 * before_shift  # the innovations flag the shift


def test_state_round_trip():
    a = AdaptiveKalmanMoments(DIM)
    for i, (_, _, m, s) in enumerate(stream("sine")):
        a(m, s, m, s, BATCH)
        if i == 20:
            break
    b = AdaptiveKalmanMoments(DIM)
    b.load_state_dict(a.state_dict())
    m, s = torch.zeros(DIM, dtype=torch.float64), torch.full((DIM,), 0.05, dtype=torch.float64)
    for x, y in zip(a(m, s, m, s, BATCH), b(m, s, m, s, BATCH)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
