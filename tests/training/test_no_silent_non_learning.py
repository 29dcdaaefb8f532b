"""Issue 26: training that learns nothing is said, naming the cause, and the cause found on a folder of
Omniglot-like classes at 32 px with `memory.method=none` is fixed.

The cause: SupCon with the pair-margin miner (the shipped default) has a dead end. Once the embeddings collapse
(every pair closer than `pos_margin`=0.2), the miner returns every negative (closer than `neg_margin`) but no
positive, and SupCon, which takes its loss over each anchor's positives, gives exactly 0 and no gradient: the
collapse never ends (measured on Omniglot, 102 classes at 32 px, batch 16, seed 1: from the third epoch on,
0 positive and all 192 negative pairs mined on every step, mean negative distance 0.05, loss 0.0000, val R@1
stuck at 0.372, below the warm-up's 0.439). The criterion now takes such a step's loss over all pairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from xbn.training.criterion import build_criterion
from xbn.training.trainer import Trainer, fit
from xbn.utils.errors import TrainingStalledError

DEFAULT_MINER = ["loss.miner=PairMarginMiner", "loss.miner_params={pos_margin: 0.2, neg_margin: 0.8}",
                 "memory.method=none"]


def collapsed_batch(n_classes: int = 4, per_class: int = 4, spread: float = 0.01):
    """Embeddings all within `spread` of one point (a collapsed embedding), 4 classes of 4."""
    torch.manual_seed(0)
    base = torch.nn.functional.normalize(torch.randn(1, 16), dim=1)
    embeddings = (base + spread * torch.randn(n_classes * per_class, 16)).requires_grad_()
    return embeddings, torch.arange(n_classes).repeat_interleave(per_class)


def test_a_collapsed_batch_still_gets_a_gradient_from_supcon_with_the_pair_miner(tiny_params):
    params = tiny_params(*DEFAULT_MINER)
    criterion = build_criterion(params, num_train_images=64)
    embeddings, labels = collapsed_batch()
    a1, p, a2, n = criterion.miner(embeddings, labels)
    assert len(a1) == 0 and len(a2) == 16 * 12  # the dead end: every negative, no positive
    assert float(criterion.loss(embeddings, labels, (a1, p, a2, n))) == 0.0  # what it used to train on
    loss = criterion(embeddings, labels)
    loss.backward()
    assert float(loss) > 0 and embeddings.grad.abs().sum() > 0
    assert criterion.take_mining() == {"steps": 1, "no_pair": 0, "no_positive": 1, "all_pairs": 1}


def test_a_miner_that_finds_no_pair_for_a_whole_window_is_said_and_stops_when_asked(tiny_params):
    # pos_margin 2 and neg_margin 0 (2 steps an epoch here): no pair can ever be mined, so the loss is 0 on every step.
    overrides = ["memory.method=none", "loss.miner=PairMarginMiner",
                 "loss.miner_params={pos_margin: 2.0, neg_margin: 0.0}", "train.warmup_epochs=0",
                 "train.epochs=1", "train.stall.window=2"]
    from xbn.stages.prepare import prepare

    prepare(tiny_params(*overrides))
    summary = fit(tiny_params(*overrides), progress=False)
    warnings = " ".join(summary["warnings"])
    assert "the miner found no pair in 2 steps: the batch is too easy" in warnings
    assert "the loss was exactly 0 for 2 steps" in warnings
    assert json.loads(Path("metrics/train.json").read_text())["warnings"] == summary["warnings"]
    with pytest.raises(TrainingStalledError, match="no pair in 2 steps"):
        fit(tiny_params(*overrides, "train.stall.action=stop"), progress=False)


def test_val_recall_below_the_warmups_for_patience_epochs_is_said(tiny_params):
    trainer = Trainer.__new__(Trainer)  # only the bookkeeping: no model, no data
    trainer.params = tiny_params("train.warmup_epochs=1", "train.stall.patience=2")
    trainer.metrics_dir, trainer.is_main = Path("metrics"), True
    from xbn.training.trainer import History

    trainer.history = History(epochs=[{"epoch": 0, "val_recall@1": 0.46}, {"epoch": 1, "val_recall@1": 0.44},
                                      {"epoch": 2, "val_recall@1": 0.35}])
    trainer.epoch = 2
    trainer._watch_validation()
    assert trainer.history.warnings == []  # one epoch below: not yet
    trainer.history.epochs.append({"epoch": 3, "val_recall@1": 0.37})
    trainer.epoch = 3
    trainer._watch_validation()
    assert trainer.history.warnings == ["[val_below_warmup] epoch 4: val R@1 has stayed below the warm-up's "
                                        "(0.4400) for 2 epochs after it (now 0.3700): training makes the model "
                                        "worse; see metrics/train_epochs.csv"]
