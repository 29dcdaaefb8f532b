"""Seeding the random generators that augmentations draw from, for one sample at a time."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch


@contextlib.contextmanager
def seeded_rngs(seed: int) -> Iterator[None]:
    """Seed Python's, NumPy's and torch's CPU generators (timm's augmentations draw from all three), then
    restore them, so the caller's random streams are untouched. Only the CPU generator: reseeding CUDA's
    (as torch.manual_seed does) would disturb the training process's GPU stream."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
