"""Where the memory's per-dimension mean and std should move to at each iteration (seed 000).

Each estimator takes the memory's current moments and the minibatch's moments and returns the target moments
the memory is mapped to. No library implements these; they are written by hand from the paper:

- `BatchMoments` (XBN, Eq. 6): the target is the current minibatch's moments.
- `KalmanMoments` (AXBN, Eq. 18-23, Algorithm 1): a per-dimension Kalman filter with a static state model
  estimates the dataset's mean and std from the noisy minibatch observations; P0 = p0, Q = q, R = r/|B|.
- `EMAMoments` (seed 000, Appendix C): estimate <- m * estimate + (1 - m) * batch, the paper's convention
  (momentum m = 0 is XBN; the paper's best is m = 0.1), i.e. the same recursion with a constant gain 1 - m.

The filter state is initialised from the memory's own moments the first time it is used (the prior that the
memory holds; its uncertainty is p0), so with r = 0 (gain 1) AXBN reduces exactly to XBN.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class BatchMoments(nn.Module):
    """XBN (Eq. 6): match the memory to the current minibatch's mean and std."""

    def forward(self, memory_mean, memory_std, batch_mean, batch_std, batch_size: int):
        return batch_mean, batch_std

    def diagnostics(self) -> dict[str, float]:
        return {"gain": 1.0}


class _RecursiveMoments(nn.Module):
    """x <- x + K (y - x) for the mean and the std, per dimension; subclasses say what the gain K is."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("std", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("gain", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def next_gain(self, batch_size: int) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, memory_mean, memory_std, batch_mean, batch_std, batch_size: int):
        if int(self.steps) == 0:
            self.mean.copy_(memory_mean)
            self.std.copy_(memory_std)
        self.gain.copy_(self.next_gain(batch_size))
        self.mean.add_(self.gain * (batch_mean - self.mean))
        self.std.add_(self.gain * (batch_std - self.std))
        self.steps += 1
        return self.mean, self.std

    def diagnostics(self) -> dict[str, float]:
        return {"gain": float(self.gain.mean())}


class KalmanMoments(_RecursiveMoments):
    """AXBN: a static-state Kalman filter per dimension (Algorithm 1).

    Predict: P- = P + q.  Update: K = P- / (P- + r/|B|), P = (1 - K) P-.  The gain is recomputed only every
    `gain_interval` iterations (Algorithm 1's N) and held in between; |B| is the global batch size.
    """

    def __init__(self, dim: int, p0: float, q: float, r: float, gain_interval: int = 1):
        super().__init__(dim)
        self.q, self.r, self.gain_interval = float(q), float(r), int(gain_interval)
        self.register_buffer("covariance", torch.full((dim,), float(p0), dtype=torch.float64))

    def next_gain(self, batch_size: int) -> torch.Tensor:
        if int(self.steps) % self.gain_interval:
            return self.gain
        predicted = self.covariance + self.q
        gain = predicted / (predicted + self.r / batch_size)
        self.covariance.copy_((1.0 - gain) * predicted)
        return gain


class EMAMoments(_RecursiveMoments):
    """An exponential moving average of the minibatch moments (Appendix C): a constant gain 1 - momentum."""

    def __init__(self, dim: int, momentum: float):
        super().__init__(dim)
        self.momentum = float(momentum)

    def next_gain(self, batch_size: int) -> torch.Tensor:
        return torch.full_like(self.gain, 1.0 - self.momentum)


class AdaptiveKalmanMoments(nn.Module):
    """AXBN without q or r to tune (`axbn_auto`; beyond seed 000, which names hand-tuned q and r as its limit).

    Two per-dimension filters, for the mean and for the std, each with its noise estimated online:
    - measurement noise from sampling theory: the batch mean of |B| samples has variance s^2/|B|, the batch
      std about s^2/(2(|B|-1)), s the std (per dimension, the filter's current estimate);
    - process noise by covariance matching on the innovations nu = y - x (Mehra 1972): E[nu^2] = P + Q + R.
      The excess (nu^2 - P - R) / R is pooled over the dimensions (one relative process noise per statistic,
      Q = q_rel * R) and averaged over ~1/`innovation_momentum` steps before it is clipped at 0: pooling cuts the
      estimate's noise by sqrt(d), and clipping only the average keeps a stationary stream's Q near 0 (clipping
      every step would bias it upwards). Drift inflates the innovations, so Q and the gain rise; a stationary
      stream lets them fall towards the 1/k averaging of a static filter.
    """

    def __init__(self, dim: int, innovation_momentum: float = 0.05):
        super().__init__()
        self.innovation_momentum = float(innovation_momentum)
        for name in ("mean", "std", "gain", "mean_covariance", "std_covariance"):
            self.register_buffer(name, torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("relative_process_noise", torch.zeros(2, dtype=torch.float64))  # mean, std
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def _update(self, slot: int, stat: str, observation: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        estimate = getattr(self, stat)
        covariance = getattr(self, f"{stat}_covariance")
        noise = noise.clamp_min(1e-30)
        innovation = observation - estimate
        if int(self.steps) == 0:
            covariance.copy_(noise)  # the prior (the memory's moments) is taken as uncertain as one batch
        else:
            excess = ((innovation * innovation - covariance - noise) / noise).mean()
            self.relative_process_noise[slot].lerp_(excess, self.innovation_momentum)
        # Under no drift the averaged excess is noise of std (1 + P/R) sqrt(2/d * b/(2-b)) (chi-square innovations,
        # pooled over d, averaged with momentum b); only what stands above twice that counts as process noise.
        b = self.innovation_momentum
        spread = (1 + (covariance / noise).mean()) * math.sqrt(2 / len(noise) * b / (2 - b))
        predicted = covariance + (self.relative_process_noise[slot] - 2 * spread).clamp_min(0.0) * noise
        gain = predicted / (predicted + noise)
        estimate.add_(gain * innovation)
        covariance.copy_((1.0 - gain) * predicted)
        return gain

    def forward(self, memory_mean, memory_std, batch_mean, batch_std, batch_size: int):
        if int(self.steps) == 0:
            self.mean.copy_(memory_mean)
            self.std.copy_(memory_std)
        # The noise comes from the filter's own std estimate, not this batch's: dividing by a noisy s^2 would
        # bias the innovation test (E[1/s^2] > 1/sigma^2) and leave a spurious process noise.
        variance = self.std * self.std
        self.gain.copy_(self._update(0, "mean", batch_mean, variance / batch_size))
        self._update(1, "std", batch_std, variance / (2 * max(batch_size - 1, 1)))
        self.steps += 1
        return self.mean, self.std

    def diagnostics(self) -> dict[str, float]:
        return {"gain": float(self.gain.mean())}
