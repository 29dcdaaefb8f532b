"""Where the memory's per-dimension mean and std should move to at each iteration (seed 000).

Each estimator takes the memory's current moments and the minibatch's moments and returns the target moments
the memory is mapped to. No library implements these; they are written by hand from the paper:

- `BatchMoments` (XBN, Eq. 6): the target is the current minibatch's moments.
- `KalmanMoments` (AXBN, Eq. 18-23, Algorithm 1): a per-dimension Kalman filter with a static state model
  estimates the dataset's mean and std from the noisy minibatch observations; P0 = p0, Q = q, R = r/|B|.
- `EMAMoments` (seed 000, Appendix C): the same recursion with a constant gain.

The filter state is initialised from the memory's own moments the first time it is used (the prior that the
memory holds; its uncertainty is p0), so with r = 0 (gain 1) AXBN reduces exactly to XBN.
"""

from __future__ import annotations

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
    """A constant gain: an exponential moving average of the minibatch moments (Appendix C)."""

    def __init__(self, dim: int, momentum: float):
        super().__init__(dim)
        self.momentum = float(momentum)

    def next_gain(self, batch_size: int) -> torch.Tensor:
        return torch.full_like(self.gain, self.momentum)
