"""How many DataLoader worker processes, and the DataLoader options that go with them (`data.num_workers`)."""

from __future__ import annotations

import math
import os
from typing import Any

MAX_AUTO_WORKERS = 8  # past ~8 workers a decode-free (cached) pipeline is no longer the bottleneck
# Batches queued ahead over all workers together: enough to absorb the uneven cost of a batch (RandAugment's
# operations differ up to ~10x in cost, and one slow batch stalls the step waiting for it), bounded so that
# pinned host memory stays small (8 batches of 64 images at 224 px are ~100 MB in uint8, ~400 MB in float32).
QUEUED_BATCHES = 8


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, which containers and `taskset` narrow; the
    machine's count where the platform has no affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        return os.cpu_count() or 1


def resolve_num_workers(value: int | str) -> int:
    """`data.num_workers`: an int as it is; `auto`: the usable cores, shared among the processes of this node
    (torchrun's LOCAL_WORLD_SIZE), less one for the process that trains, at most `MAX_AUTO_WORKERS`; 0 (load in
    the training process) on a single core."""
    if isinstance(value, int):
        return value
    if value != "auto":
        raise ValueError(f"data.num_workers: an integer >= 0 or 'auto', not {value!r}")
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    return max(0, min(MAX_AUTO_WORKERS, usable_cores() // local - 1))


def loader_options(num_workers: int, device_type: str, persistent: bool = True,
                   queued_batches: int | None = QUEUED_BATCHES) -> dict[str, Any]:
    """DataLoader keyword arguments for `num_workers` resolved workers: pinned memory on CUDA (the copy to the
    device is then asynchronous), persistent workers across epochs when asked (no process start-up per epoch;
    safe for training because every sample's augmentation is seeded by its own (seed, epoch, index), not by a
    worker's state), and a `prefetch_factor` that keeps about `queued_batches` batches queued whatever the
    worker count (None: torch's default of 2 per worker, for batch samplers whose batches must stay fresh)."""
    options: dict[str, Any] = {"num_workers": num_workers, "pin_memory": device_type == "cuda"}
    if num_workers > 0:
        options["persistent_workers"] = persistent
        if queued_batches is not None:
            options["prefetch_factor"] = max(2, math.ceil(queued_batches / num_workers))
    return options
