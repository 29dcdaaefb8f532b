"""Batch samplers by name (`train.sampler.name`), after Roth et al. 2020 ("Revisiting Training Strategies and
Generalization Performance in Deep Metric Learning", ICML, Sec. 4.3):

- `spc_n`: P classes x M (= train.samples_per_class) images (`ClassBalancedBatchSampler`);
- `spc_r`: b - 1 random images plus a positive of one of them, no class structure (`RandomBatchSampler`);
- `greedy_coreset`, `ddm`, `frd`: embedded samplers choosing each batch from a pool of b* candidates by their
  embeddings in a bank that the training stream refreshes (`EmbeddedBatchSampler`; they have `observe`).

Every sampler yields lists of training-set indices, is a pure function of (seed, epoch) (and of its bank) and
exposes `effective_batch_size`, `set_epoch` and `__len__`, as `RankBatchSampler` expects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from xbn.data.sampler import ClassBalancedBatchSampler
from xbn.data.samplers.ddm import DistanceMatchBatchSampler
from xbn.data.samplers.embedded import EmbeddedBatchSampler
from xbn.data.samplers.frd import FrechetMatchBatchSampler
from xbn.data.samplers.greedy_coreset import GreedyCoresetBatchSampler
from xbn.data.samplers.spc_r import RandomBatchSampler

EMBEDDED = {s.name: s for s in (GreedyCoresetBatchSampler, DistanceMatchBatchSampler, FrechetMatchBatchSampler)}
SAMPLER_NAMES = ("spc_n", "spc_r", *EMBEDDED)

__all__ = ["EMBEDDED", "SAMPLER_NAMES", "DistanceMatchBatchSampler", "EmbeddedBatchSampler",
           "FrechetMatchBatchSampler", "GreedyCoresetBatchSampler", "RandomBatchSampler", "build_batch_sampler"]


def build_batch_sampler(config: Any, labels: Sequence[int] | np.ndarray, batch_size: int, samples_per_class: int,
                        seed: int, batches_per_epoch: int | None = None):
    """The batch sampler `config` (a `SamplerConfig`: name, draw, candidates, selection, candidate_batches,
    trials, projection_dim, bins) names."""
    name = config.name
    if name == "spc_n":
        return ClassBalancedBatchSampler(labels, batch_size, samples_per_class, seed, batches_per_epoch)
    if name == "spc_r":
        return RandomBatchSampler(labels, batch_size, seed, batches_per_epoch, draw=config.draw)
    if name not in EMBEDDED:
        raise ValueError(f"unknown batch sampler '{name}' (known: {', '.join(SAMPLER_NAMES)})")
    extra = {"bins": config.bins} if name == "ddm" else {}
    if name in ("ddm", "frd"):
        extra.update(selection=config.selection, candidate_batches=config.candidate_batches)
    return EMBEDDED[name](labels, batch_size, samples_per_class, seed, candidates=config.candidates,
                          projection_dim=config.projection_dim, trials=config.trials,
                          batches_per_epoch=batches_per_epoch, **extra)
