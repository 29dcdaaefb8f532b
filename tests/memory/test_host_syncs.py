"""The memory's per-step update never waits for the device: no tensor is read as a Python number (each such
read synchronises the host with a GPU's queue). Counted on the CPU by patching every Tensor-to-Python
conversion; the diagnostics are read only when the trainer logs (`Criterion.diagnostics`)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from xbn.config import load_params
from xbn.training.criterion import build_criterion

CONVERSIONS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


@contextlib.contextmanager
def counted_conversions():
    counts = {"n": 0}
    originals = {name: getattr(torch.Tensor, name) for name in CONVERSIONS}

    def counting(name):
        def wrapper(self, *args, **kwargs):
            counts["n"] += 1
            return originals[name](self, *args, **kwargs)
        return wrapper

    for name in CONVERSIONS:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def batch(step, n=16, d=8):
    g = torch.Generator().manual_seed(step)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1), torch.arange(n) // 4 + step % 5


@pytest.mark.parametrize("method", ["xbm", "xbn", "axbn", "ema", "axbn_auto"])
def test_the_memory_update_reads_nothing_back_from_the_device(method):
    params = load_params(None, [f"memory.method={method}", "model.embedding_dim=8", "memory.size=40",
                                "memory.start=0", "memory.kalman.gain_interval=2", "loss.miner=null"])
    memory = build_criterion(params, num_train_images=40).memory
    memory.refresh_interval = 3  # the exact recomputation of the sums runs inside the counted steps
    with counted_conversions() as counts:
        for step in range(8):  # filling, wrapping around (40 rows, 16 per step), refreshing, gain held/updated
            memory.add_to_memory(*batch(step), 16)
    assert counts["n"] == 0
    assert memory.has_been_filled and memory.adaptation_steps == 7
    # The conversions happen where the trainer asks for them, every train.log_every steps: one read per value
    # (none for xbm, whose rows are never mapped, so nothing can have turned non-finite).
    with counted_conversions() as counts:
        memory.check_finite()
    assert counts["n"] == (0 if method == "xbm" else 1)


def test_the_counter_detects_a_read(monkeypatch):
    # The counter is not vacuous: the old per-step diagnostics read (float(mean)) is one conversion.
    with counted_conversions() as counts:
        float(torch.ones(3).mean())
        bool(torch.ones(()) > 0)
    assert counts["n"] == 2


def test_the_sums_and_rows_match_a_direct_computation_after_wrapping():
    # Counting the dequeued rows in Python (not with a boolean mask) keeps the running sums exact.
    params = load_params(None, ["memory.method=xbn", "model.embedding_dim=8", "memory.size=40",
                                "memory.start=0", "loss.miner=null"])
    memory = build_criterion(params, num_train_images=40).memory
    memory.refresh_interval = 1000
    for step in range(7):
        memory.add_to_memory(*batch(step), 16)
    rows = memory.valid_rows().double()
    # float32 rows vs float64 sums: rounding of ~1e-7 per map, far below a miscounted row (~0.1).
    torch.testing.assert_close(memory.row_sum, rows.sum(0), rtol=0, atol=1e-5)
    torch.testing.assert_close(memory.row_sq_sum, (rows * rows).sum(0), rtol=0, atol=1e-5)
