"""This process's device and random seeds, the same for every stage that runs a model."""

from __future__ import annotations

import random

import numpy as np
import torch

from xbn.utils import distributed


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"train.device={name} but CUDA is not available on this machine")
    if device.type == "cuda" and distributed.world_size() > 1:
        return torch.device("cuda", distributed.local_rank())  # one GPU per process: the one torchrun assigns
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work: CUDA runs asynchronously, so a timer must wait for the work, not its
    launch. A no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
