"""benchmarks/memory_bench.py: the timed step is the training step. On clustered embeddings of a fixed class
set the default criterion's miner returns positives and hard negatives; on random vectors with fresh labels
(the old workload) it returns no negative, and the benchmark refuses such a workload. Ratios are per step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from benchmarks import memory_bench
from benchmarks.memory_bench import (
    ClusteredWorkload,
    SavedWorkload,
    build,
    fill,
    measure,
    mined_pairs,
    targets,
)

CPU = torch.device("cpu")


def _filled(method: str, workload, rows: int, batch: int):
    module = build(method, rows, workload.dim, batch, CPU)
    fill(module, *workload.memory(rows))
    return module


@pytest.mark.parametrize("method", ["xbm", "axbn", "pml"])
def test_clustered_workload_makes_the_miner_return_pairs(method):
    workload = ClusteredWorkload(dim=512)
    module = _filled(method, workload, 1024, 16)
    mined = mined_pairs(module, *workload.batch(16))
    # 16 rows against 1024: every class appears ~2 times in the memory, and a few % of negatives are hard
    assert mined["positive_pairs"] > 0
    assert 0 < mined["negative_pairs"] < 16 * 1024 * 0.5


def test_batches_come_from_the_fixed_class_set_four_per_class():
    workload = ClusteredWorkload(dim=32, num_classes=10)
    x, y = workload.batch(16)
    assert torch.allclose(x.norm(dim=1), torch.ones(16))
    assert set(y.tolist()) <= set(range(10)) and torch.bincount(y).max() == 4 and len(set(y.tolist())) == 4


class _RandomWorkload:
    """The old workload: random unit vectors, labels never seen before."""
    dim = 512

    def __init__(self):
        self.step = 0

    def memory(self, rows):
        return torch.nn.functional.normalize(torch.randn(rows, self.dim), dim=1), torch.randint(0, rows // 4, (rows,))

    def batch(self, size):
        self.step += 1
        return (torch.nn.functional.normalize(torch.randn(size, self.dim), dim=1),
                torch.arange(size) // 4 + 10_000 * self.step)


def test_random_vectors_with_new_labels_give_no_negatives_and_are_refused():
    workload = _RandomWorkload()
    assert mined_pairs(_filled("xbm", workload, 1024, 16), *workload.batch(16))["negative_pairs"] == 0
    with pytest.raises(RuntimeError, match="miner returned"):
        measure(_RandomWorkload(), 1024, 16, steps=1, warmup=0, device=CPU, methods=("none", "xbm"))


def test_measure_reports_paired_per_step_ratios():
    row = measure(ClusteredWorkload(dim=64), 256, 16, steps=3, warmup=0, device=CPU,
                  methods=("none", "pml", "xbm", "axbn"))
    assert {"axbn/xbm", "axbn/pml", "axbn/none", "xbm/pml", "pml/xbm"} <= set(row["paired_ratio"])
    steps = row["per_step_ms"]
    ratios = sorted(a / b for a, b in zip(steps["axbn"], steps["xbm"]))
    got = row["paired_ratio"]["axbn/xbm"]
    # the median of the per-step ratios, not the ratio of medians (times are rounded to the microsecond)
    assert got["n"] == 3 and got["median"] == pytest.approx(ratios[1], rel=1e-2)
    assert got["p25"] <= got["median"] <= got["p75"]
    ci = row["paired_ratio_ci"]["axbn/xbm"]
    assert ci["median"] == got["median"] and ci["low"] <= ci["median"] <= ci["high"]
    assert ci["low"] >= ratios[0] * 0.99 and ci["high"] <= ratios[2] * 1.01  # within the measured ratios
    # The step's ratio decomposed: each memory's update alone, and the pairs mined against each memory.
    assert set(row["update_ms"]) == set(row["mined_pairs_last_batch"]) == {"pml", "xbm", "axbn"}
    assert all(v > 0 for v in row["update_ms"].values()) and row["update_over_xbm_step"]["xbm"] == 0
    # The update timed inside each step: XBM's step with XBM's update swapped for the method's, per round.
    update = row["adaptation_ratio"]["axbn/xbm"]
    assert set(row["adaptation_ratio"]) == {"axbn/xbm"} and update["n"] == 3
    assert update["p25"] <= update["median"] <= update["p75"]


def test_the_adaptation_ratio_swaps_xbms_update_for_the_methods_in_xbms_step():
    steps = {"xbm": [0.010, 0.020, 0.010]}
    updates = {"xbm": [0.001, 0.001, 0.001], "xbn": [0.002, 0.003, 0.0015], "pml": [0.0005] * 3}
    got = memory_bench.adaptation_ratio(steps, updates)
    assert set(got) == {"xbn/xbm"}  # PML's memory is not an adaptation
    # per round: 1 + (0.001 / 0.010), 1 + (0.002 / 0.020), 1 + (0.0005 / 0.010)
    assert got["xbn/xbm"]["median"] == pytest.approx(1.1) and got["xbn/xbm"]["n"] == 3


def test_without_a_miner_every_pair_is_counted_and_the_loss_work_is_the_same_for_every_memory():
    workload = ClusteredWorkload(dim=64)
    module = build("xbn", 256, 64, 16, CPU, ("loss.miner=null",))
    fill(module, *workload.memory(256))
    assert module.memory.miner is None
    x, y = workload.batch(16)
    pairs = mined_pairs(module, x, y)
    assert pairs["positive_pairs"] + pairs["negative_pairs"] == 16 * 256
    row = measure(workload, 256, 16, steps=2, warmup=0, device=CPU, methods=("none", "xbm", "xbn"),
                  overrides=("loss.miner=null",))
    assert row["mined_pairs_last_batch"]["xbm"] == row["mined_pairs_last_batch"]["xbn"]


def test_targets_read_the_medians_whole_interval_at_the_largest_memory():
    def row(size, low, high):
        # single steps spread far wider than the median's interval: the IQR must not decide
        return {"workload": "clustered", "memory_size": size, "batch": 16,
                "paired_ratio": {"axbn/xbm": {"median": (low + high) / 2, "p25": 0.9, "p75": 1.2, "n": 9},
                                 "xbm/pml": {"median": 1.0, "p25": 0.9, "p75": 1.2, "n": 9}},
                "paired_ratio_ci": {"axbn/xbm": {"median": (low + high) / 2, "low": low, "high": high, "n": 9},
                                    "xbm/pml": {"median": 1.04, "low": 1.03, "high": 1.05, "n": 9}}}

    found = {t["ratio"]: t["verdict"] for t in targets([row(1024, 2.0, 3.0), row(4096, 1.01, 1.03)])}
    assert found == {"axbn/xbm": "inconclusive", "xbm/pml": "missed"}
    met = targets([row(4096, 0.99, 1.015)])[0]
    assert met["verdict"] == "met" and (met["p25"], met["p75"]) == (0.9, 1.2)  # the IQR is shown beside it


def test_saved_embeddings_are_a_workload(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "saved.npz"
    np.savez(path, embeddings=rng.standard_normal((40, 8)), labels=np.repeat(np.arange(10), 4))
    x, y = SavedWorkload(path).batch(8)
    assert x.shape == (8, 8) and torch.bincount(y).max() == 4
    np.savez(path, embeddings=rng.standard_normal((6, 8)), labels=np.arange(6))
    with pytest.raises(ValueError, match="no class has 4"):
        SavedWorkload(path)


def test_the_default_criterion_is_params_yaml(monkeypatch):
    criterion = build("axbn", 256, 64, 16, CPU)
    assert type(criterion.loss).__name__ == "SupConLoss" and type(criterion.miner).__name__ == "PairMarginMiner"
    assert criterion.memory.memory_size == 256 and memory_bench.memory_of(criterion) is criterion.memory
