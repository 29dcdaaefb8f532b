"""A non-finite gain or memory statistic stops training, naming the iteration where it happened, with the stored
rows left as they were: it never trains on to the end with a NaN memory. The update decides on the device
(no host wait per step) and `check_finite`, which the trainer calls when it logs and before each checkpoint,
raises."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from xbn.config import load_params
from xbn.training.criterion import build_criterion
from xbn.stages.prepare import prepare
from xbn.training.trainer import Trainer
from xbn.utils.errors import NonFiniteLossError

D = 8


def unit(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, D, generator=g), dim=1)


def labels(n, step):
    return torch.arange(n) // 4 + 10 * step


def test_a_non_finite_kalman_gain_is_named_by_its_iteration_and_leaves_the_stored_rows():
    params = load_params(None, ["memory.method=axbn", "model.embedding_dim=8", "memory.size=64",
                                "memory.start=0", "loss.miner=null"])
    crit = build_criterion(params, num_train_images=64)
    crit(unit(16, 0), labels(16, 0))  # iteration 1 stores rows; 2 is the first memory update
    # What q = inf (refused in params now) or an overflowing P + Q does: the predicted covariance is inf.
    crit.memory.moments.covariance.fill_(float("inf"))
    stored = crit.memory.embedding_memory.clone()
    expected = r"at iteration 2: the memory's target moments are not finite \(mean: 8 of 8 dims non-finite, " \
               r"std: 8 of 8; Kalman gain"
    crit(unit(16, 1), labels(16, 1))
    crit(unit(16, 2), labels(16, 2))  # later updates do not overwrite the record of the first
    with pytest.raises(NonFiniteLossError, match=expected):
        crit.check_finite()
    assert torch.equal(crit.memory.embedding_memory[:16], stored[:16])  # the map became the identity


def test_a_non_finite_batch_is_named_and_leaves_xbn_rows_as_they_were():
    params = load_params(None, ["memory.method=xbn", "model.embedding_dim=8", "memory.size=64",
                                "memory.start=0", "loss.miner=null"])
    crit = build_criterion(params, num_train_images=64)
    for step in range(3):
        crit(unit(16, step), labels(16, step))
    stored = crit.memory.embedding_memory.clone()
    batch = unit(16, 3)
    batch[5, 2] = float("inf")
    crit.check_finite()  # nothing recorded yet
    crit(batch, labels(16, 3))
    with pytest.raises(NonFiniteLossError, match=r"at iteration 4: .* batch finite: False"):
        crit.check_finite()
    assert torch.equal(crit.memory.embedding_memory[:48], stored[:48])


def test_training_stops_naming_the_iteration_and_keeps_the_last_checkpoint(tiny_params):
    params = tiny_params("memory.method=axbn", "train.epochs=1")
    prepare(params)
    trainer = Trainer(params, progress=False)
    trainer.fit()  # 2 epochs (1 warm-up), the memory from epoch 2 on
    before = Path("models/last.pt").read_bytes()
    trainer.params.train.epochs = 2
    trainer.criterion.memory.moments.q = float("inf")  # the gain of the next recomputation is NaN
    trainer.criterion.memory.moments.gain_interval = 1
    with pytest.raises(NonFiniteLossError, match=rf"at iteration {trainer.iteration + 1}: the memory's "):
        trainer.fit()
    assert Path("models/last.pt").read_bytes() == before


def test_xbn_train_reports_a_non_finite_loss_in_one_line_with_exit_1(tiny_params, monkeypatch, capsys):
    # The raising itself is pinned above; here the CLI's mapping: one line naming the iteration, exit 1, no
    # traceback (the fault is injected where the loop would raise it).
    from xbn.cli import main
    from xbn.stages import train as stage

    from tests_support import ROOT, TINY

    message = "memory update at iteration 7: the Kalman gain is not finite"

    def diverge(*args, **kwargs):
        raise NonFiniteLossError(message)

    monkeypatch.setattr(stage, "fit", diverge)
    assert main(["train", "--params", str(ROOT / "params.yaml"), "-q", *(f"--set={o}" for o in TINY)]) == 1
    assert capsys.readouterr().err.strip() == f"xbn train: {message}"


def test_without_a_trainer_the_update_is_named_by_its_count_and_the_report_counts_dims():
    from pytorch_metric_learning import losses

    from xbn.memory import CrossBatchMemory
    from xbn.memory.moments import KalmanMoments

    memory = CrossBatchMemory(losses.SupConLoss(), D, 64, moments=KalmanMoments(D, p0=1.0, q=0.1, r=1.0))
    memory.add_to_memory(unit(16, 0), labels(16, 0), 16)  # stores rows: no update yet
    memory.add_to_memory(unit(16, 1), labels(16, 1), 16)  # memory update 1, finite
    memory.check_finite()
    batch = unit(16, 2)
    batch[3, [1, 4]] = float("nan")  # two dims of the batch, hence of the Kalman mean and std
    stored = memory.embedding_memory[:32].clone()
    memory.add_to_memory(batch, labels(16, 2), 16)
    assert torch.equal(memory.embedding_memory[:32], stored)
    with pytest.raises(NonFiniteLossError, match=r"at memory update 2: .*mean: 2 of 8 dims non-finite, std: 2 of "
                                                 r"8; Kalman gain non-finite in 0 dims; batch finite: False, "
                                                 r"memory moments finite: True\)"):
        memory.check_finite()
