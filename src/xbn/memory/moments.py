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

import abc
import math

import torch
from torch import nn


class MomentEstimator(nn.Module, abc.ABC):
    """What `CrossBatchMemory` calls: forward(memory_mean, memory_std, batch_mean, batch_std, batch_size) ->
    (target_mean, target_std), and `diagnostics()`, read when the trainer logs."""

    @abc.abstractmethod
    def diagnostics(self) -> dict[str, float | torch.Tensor]:
        """The estimator's gain (a float or a 0-d device tensor), for the trainer's log."""


class BatchMoments(MomentEstimator):
    """XBN (Eq. 6): match the memory to the current minibatch's mean and std."""

    def forward(self, memory_mean, memory_std, batch_mean, batch_std, batch_size: int):
        return batch_mean, batch_std

    def diagnostics(self) -> dict[str, float | torch.Tensor]:
        return {"gain": 1.0}


class _CountedMoments(MomentEstimator):
    """A step counter kept twice: a buffer, saved with the state, and a Python int that the per-step branches
    read, so that no step waits for the device (reading a CUDA tensor as a number synchronises the host)."""

    steps: torch.Tensor  # buffers, declared for the type checker (nn.Module types its attributes Tensor | Module)
    gain: torch.Tensor  # every subclass keeps its per-dimension gain as a buffer

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.count = 0

    def _advance(self) -> None:
        self.steps.add_(1)  # in place: `+=` would also go through nn.Module.__setattr__ every step
        self.count += 1

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.count = int(self.steps)  # once per load, not per step

    def diagnostics(self) -> dict[str, float | torch.Tensor]:
        """The mean gain as a 0-d device tensor: the caller reads it only when it logs."""
        return {"gain": self.gain.mean()}


class _RecursiveMoments(_CountedMoments):
    """x <- x + K (y - x) for the mean and the std, per dimension; subclasses say what the gain K is."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("std", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("gain", torch.zeros(dim, dtype=torch.float64))

    def next_gain(self, batch_size: int) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, memory_mean, memory_std, batch_mean, batch_std, batch_size: int):
        if self.count == 0:
            self.mean.copy_(memory_mean)
            self.std.copy_(memory_std)
        gain = self.next_gain(batch_size)
        if gain is not self.gain:  # a held gain is already in place
            self.gain.copy_(gain)
        # x + K (y - x) in one operation each (a few microseconds of dispatch saved per step at small M).
        self.mean.lerp_(batch_mean, self.gain)
        self.std.lerp_(batch_std, self.gain)
        self._advance()
        return self.mean, self.std


class KalmanMoments(_RecursiveMoments):
    """AXBN: a static-state Kalman filter per dimension (Algorithm 1).

    Predict: P- = P + q.  Update: K = P- / (P- + r/|B|), P = (1 - K) P-.  The gain is recomputed only every
    `gain_interval` iterations (Algorithm 1's N) and held in between; |B| is the global batch size.
    """

    covariance: torch.Tensor

    def __init__(self, dim: int, p0: float, q: float, r: float, gain_interval: int = 1):
        super().__init__(dim)
        self.q, self.r, self.gain_interval = float(q), float(r), int(gain_interval)
        self.register_buffer("covariance", torch.full((dim,), float(p0), dtype=torch.float64))

    def next_gain(self, batch_size: int) -> torch.Tensor:
        if self.count % self.gain_interval:
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
        if self.count == 0:  # constant: written once (and saved with the state)
            self.gain.fill_(1.0 - self.momentum)
        return self.gain


class AdaptiveKalmanMoments(_CountedMoments):
    """AXBN without q or r to tune (`axbn_auto`; beyond seed 000, which names hand-tuned q and r as its limit).

    Two per-dimension filters, for the mean and for the std, each with its noise estimated online:
    - measurement noise from sampling theory: the batch mean of |B| samples has variance s^2/|B|, the batch
      std about s^2/(2(|B|-1)), s the std (per dimension, the filter's current estimate);
    - process noise by covariance matching on the innovations nu = y - x (Mehra 1972): E[nu^2] = P + Q + R.
      One relative process noise per statistic, Q = q_rel * R, is estimated from the ratios
      nu^2 / (P + R) (chi-square with one degree of freedom under no drift) pooled over the dimensions by
      their median, and averaged over ~1/`innovation_momentum` steps before it is clipped at 0: pooling cuts
      the estimate's noise by ~sqrt(d), and clipping only the average keeps a stationary stream's Q near 0
      (clipping every step would bias it upwards). Drift inflates the innovations, so Q and the gain rise; a
      stationary stream lets them fall towards the 1/k averaging of a static filter.
    - The median, not the mean: a mean lets one dimension outvote the others, e.g. a near-constant one
      (tiny R) whose level moves by an amount negligible anywhere else; its huge ratio would raise every
      dimension's gain towards 1 (XBN). The median ignores up to half the dimensions.
    """

    mean: torch.Tensor
    std: torch.Tensor
    mean_covariance: torch.Tensor
    std_covariance: torch.Tensor
    relative_process_noise: torch.Tensor

    def __init__(self, dim: int, innovation_momentum: float = 0.05):
        super().__init__()
        self.innovation_momentum = float(innovation_momentum)
        for name in ("mean", "std", "gain", "mean_covariance", "std_covariance"):
            self.register_buffer(name, torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("relative_process_noise", torch.zeros(2, dtype=torch.float64))  # mean, std
        # Constants of `dim` alone (not state): the null law of the pooled statistic.
        self.null_median, self.null_median_std = self.chi2_median_moments(dim)

    @staticmethod
    def chi2_median_moments(n: int, points: int = 200_000) -> tuple[float, float]:
        """Mean and std of `torch.median` (the lower middle value, the k = (n+1)//2-th smallest) of n
        independent chi-square(1) variables: quadrature over the order statistic's Beta(k, n-k+1) law, u being
        the chi-square CDF, x(u) = ndtri((1+u)/2)^2 its quantile. Exact for every n (large n: the asymptotic
        median 0.4549 and std 1/(2 f(0.4549) sqrt(n)), f the chi-square(1) density; small n differs: the mean
        is 0.45 * 0.975 at n = 16 but 0.45 * 1.13 at n = 15)."""
        k = (n + 1) // 2
        u = (torch.arange(points, dtype=torch.float64) + 0.5) / points
        x = torch.special.ndtri((1 + u) / 2) ** 2
        log_beta = math.lgamma(k) + math.lgamma(n - k + 1) - math.lgamma(n + 1)
        w = ((k - 1) * u.log() + (n - k) * torch.log1p(-u) - log_beta).exp() / points
        mean = float((w * x).sum())
        return mean, math.sqrt(max(float((w * x * x).sum()) - mean * mean, 0.0))

    def _update(self, slot: int, stat: str, observation: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        estimate = getattr(self, stat)
        covariance = getattr(self, f"{stat}_covariance")
        noise = noise.clamp_min(1e-30)
        innovation = observation - estimate
        if self.count == 0:
            covariance.copy_(noise)  # the prior (the memory's moments) is taken as uncertain as one batch
        ratio_to_noise = (covariance / noise).median()  # P/R, the same in every dimension but for R's updates
        if self.count > 0:
            # With Q = q R, nu^2 / (P + R) is chi-square(1) times c = 1 + q / (1 + P/R); the median over
            # its null mean estimates c without bias under no drift (the median of chi2_1 - 1 is -0.545, not
            # 0), so q = (c - 1)(1 + P/R) keeps the mean pooling's expectation.
            scale = (innovation * innovation / (covariance + noise)).median() / self.null_median
            excess = (scale - 1) * (1 + ratio_to_noise)
            self.relative_process_noise[slot].lerp_(excess, self.innovation_momentum)
        # Under no drift the averaged q is noise of std (1 + P/R) * sd0 / m0 * sqrt(b/(2-b)) (m0, sd0: the
        # null median's mean and std, `chi2_median_moments`; b/(2-b) the variance factor of averaging with
        # momentum b); only what stands above twice that counts as process noise.
        b = self.innovation_momentum
        spread = (1 + ratio_to_noise) * self.null_median_std / self.null_median * math.sqrt(b / (2 - b))
        predicted = covariance + (self.relative_process_noise[slot] - 2 * spread).clamp_min(0.0) * noise
        gain = predicted / (predicted + noise)
        estimate.add_(gain * innovation)
        covariance.copy_((1.0 - gain) * predicted)
        return gain

    def forward(self, memory_mean, memory_std, batch_mean, batch_std, batch_size: int):
        if self.count == 0:
            self.mean.copy_(memory_mean)
            self.std.copy_(memory_std)
        # The noise comes from the filter's own std estimate, not this batch's: dividing by a noisy s^2 would
        # bias the innovation test (E[1/s^2] > 1/sigma^2) and leave a spurious process noise.
        variance = self.std * self.std
        self.gain.copy_(self._update(0, "mean", batch_mean, variance / batch_size))
        self._update(1, "std", batch_std, variance / (2 * max(batch_size - 1, 1)))
        self._advance()
        return self.mean, self.std
