"""Issue 52: the memory path's dead end. With SupCon and the pair-margin miner (the shipped default), a batch and a
memory whose embeddings have bunched within the miner's positive margin (0.2) mine every negative and no
positive; SupCon then gives exactly 0 and no gradient, and nothing ever moves again. The memory path now takes
that step's loss over all pairs (`loss.no_positive: all_pairs`), the rule the minibatch path already had, and
says how often it did (`take_mining`)."""

from __future__ import annotations

import pytest
import torch

from xbn.config import load_params
from xbn.training.criterion import build_criterion

DIM, CLASSES, PER_CLASS = 16, 4, 4


def trapped(spread: float = 0.01, seed: int = 0):
    """A batch of 4 classes x 4 within `spread` of one unit vector, as every embedding is after a collapse."""
    base = torch.nn.functional.normalize(torch.randn(1, DIM, generator=torch.Generator().manual_seed(0)), dim=1)
    g = torch.Generator().manual_seed(seed)
    rows = torch.nn.functional.normalize(base + spread * torch.randn(CLASSES * PER_CLASS, DIM, generator=g), dim=1)
    return rows, torch.arange(CLASSES).repeat_interleave(PER_CLASS)


def criterion(method: str, no_positive: str = "all_pairs", *extra: str):
    params = load_params(None, [f"memory.method={method}", f"model.embedding_dim={DIM}", "memory.size=64",
                                "memory.start=0", "memory.add_batch_loss=false", f"loss.no_positive={no_positive}",
                                *extra])
    return build_criterion(params, num_train_images=64)


def fill(crit, steps: int = 3):
    """The memory full of collapsed rows (the trapped state), written by earlier steps."""
    with torch.no_grad():
        for step in range(steps):
            crit(*trapped(seed=step + 1))


def trapped_step(crit) -> tuple[float, torch.Tensor, dict[str, int]]:
    """One step of a trapped batch against `crit`'s trapped memory: its loss, its gradient, and the mining
    counts of that step alone."""
    fill(crit)
    crit.take_mining()
    embeddings, labels = trapped(seed=9)
    embeddings.requires_grad_()
    loss = crit(embeddings, labels)
    loss.backward()
    return float(loss.detach()), embeddings.grad, crit.take_mining()


@pytest.mark.parametrize("method", ["xbm", "xbn", "axbn", "oracle"])
def test_a_collapsed_memory_still_gives_a_gradient(method):
    loss, grad, counts = trapped_step(criterion(method))
    assert loss > 0 and grad.abs().sum() > 0
    assert counts["memory_steps"] == 1 and counts["memory_no_positive"] == 1 and counts["memory_all_pairs"] == 1


@pytest.mark.parametrize("method", ["xbm", "xbn"])
def test_without_the_fallback_the_trapped_memory_gives_exactly_zero_and_no_gradient(method):
    # PML's own behaviour, kept as loss.no_positive=zero: what made the memory arms stop learning for good.
    loss, grad, counts = trapped_step(criterion(method, "zero"))
    assert loss == 0.0 and grad.abs().sum() == 0
    assert counts["memory_no_positive"] == 1 and counts["memory_all_pairs"] == 0
    assert counts["memory_zero_loss"] == 1


def test_the_fallback_takes_exactly_the_loss_over_all_pairs_without_the_batch_itself():
    # The repaired step equals the memory's loss with no miner at all (PML's all pairs, self-comparisons out).
    repaired, all_pairs = criterion("xbm"), criterion("xbm", "all_pairs", "loss.miner=null")
    fill(repaired)
    fill(all_pairs)
    embeddings, labels = trapped(seed=9)
    assert torch.allclose(repaired(embeddings, labels), all_pairs(embeddings, labels), atol=1e-6)


def test_a_memory_that_mines_positives_is_left_as_the_miner_chose():
    crit = criterion("xbm")
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        crit(torch.nn.functional.normalize(torch.randn(16, DIM, generator=g), dim=1),
             torch.arange(CLASSES).repeat_interleave(PER_CLASS))
    counts = crit.take_mining()
    assert counts["memory_steps"] == 3 and counts["memory_no_positive"] == 0 and counts["memory_all_pairs"] == 0


def test_the_spread_of_a_batch_against_a_hand_computation():
    from xbn.training.figures import spread

    e = torch.nn.functional.normalize(torch.randn(6, DIM, generator=torch.Generator().manual_seed(5)), dim=1)
    memory_mean = torch.randn(DIM, generator=torch.Generator().manual_seed(6))
    norm, pair_cosine, to_memory = spread(e, memory_mean).tolist()
    cos = e @ e.T
    assert pair_cosine == pytest.approx(float((cos.sum() - cos.trace()) / 30), abs=1e-6)
    assert norm == pytest.approx(float(e.mean(0).norm()), abs=1e-6)
    assert to_memory == pytest.approx(float(torch.nn.functional.cosine_similarity(e.mean(0), memory_mean, 0)),
                                      abs=1e-6)
    collapsed, _ = trapped(spread=0.001)
    assert spread(collapsed, collapsed.mean(0)).tolist() == pytest.approx([1, 1, 1], abs=1e-4)


def test_the_figures_read_back_the_memory_losses_and_pairs_of_the_steps_since_the_last_read():
    crit = criterion("xbm", "zero")
    fill(crit)
    crit.figures.take()
    crit(*trapped(seed=9))
    figures = crit.diagnostics()
    assert figures["memory_loss"] == 0 and figures["memory_positives"] == 0 and figures["memory_no_positive"] == 1
    assert figures["memory_negatives"] == 16 * 12 + 16 * 3 * 12  # this batch's other classes, and 3 stored batches'
    assert figures["batch_cosine"] > 0.99 and "batch_loss" not in figures  # the memory loss alone
    assert crit.figures.take() == {}


def test_a_memory_loss_that_sits_at_zero_for_a_window_is_said_as_the_batch_paths_stall_is():
    from pathlib import Path

    from xbn.training.trainer import History, Trainer

    trainer = Trainer.__new__(Trainer)  # only the bookkeeping of train.stall: no model, no data
    trainer.params = load_params(None, ["train.stall.window=2", "loss.no_positive=zero"])
    trainer.metrics_dir, trainer.is_main, trainer.epoch = Path("metrics"), True, 3
    trainer.history, trainer.window_steps, trainer.window_zero_loss = History(), 0, 0
    trainer.criterion = criterion("xbm", "zero")
    fill(trainer.criterion)
    trainer.criterion.take_mining()
    for step in range(2):
        loss = trainer.criterion(*trapped(seed=10 + step))
        trainer._watch_steps(float(loss))
    kinds = [w.split("]")[0][1:] for w in trainer.history.warnings]
    assert kinds == ["zero_loss", "memory_no_positive", "memory_zero_loss"]  # the batch path never mined here
    assert "no positive pair against the memory in 2 steps" in trainer.history.warnings[1]
    assert "the memory loss was exactly 0 for 2 steps" in trainer.history.warnings[2]


def test_a_centred_gradient_moves_no_anchor_with_the_batch_and_leaves_the_loss_as_it_was():
    plain = criterion("xbm", "all_pairs", "memory.center_gradient=false")
    centred = criterion("xbm", "all_pairs", "memory.center_gradient=true")
    g = torch.Generator().manual_seed(4)
    old = torch.nn.functional.normalize(torch.randn(48, DIM, generator=g), dim=1)
    for crit in (plain, centred):
        crit(old, torch.arange(48) % CLASSES)
    e = torch.nn.functional.normalize(torch.randn(16, DIM, generator=g), dim=1)
    y = torch.arange(CLASSES).repeat_interleave(PER_CLASS)
    grads = []
    for crit in (plain, centred):
        x = e.clone().requires_grad_()
        loss = crit(x, y)
        loss.backward()
        grads.append((float(loss.detach()), x.grad))
    (loss_plain, grad_plain), (loss_centred, grad_centred) = grads
    assert loss_centred == pytest.approx(loss_plain, abs=1e-6)
    assert grad_plain.mean(0).abs().max() > 1e-4  # the common part the batch would move by
    assert grad_centred.mean(0).abs().max() < 1e-6
    assert torch.allclose(grad_centred, grad_plain - grad_plain.mean(0), atol=1e-6)



def test_memory_mine_false_takes_every_pair_against_the_memory_and_keeps_the_miner_on_the_minibatch():
    mined, unmined = criterion("xbm"), criterion("xbm", "all_pairs", "memory.mine=false")
    no_miner = criterion("xbm", "all_pairs", "loss.miner=null")
    assert unmined.miner is not None and unmined.memory.miner is None and mined.memory.miner is mined.miner
    g = torch.Generator().manual_seed(3)
    stored = torch.nn.functional.normalize(torch.randn(48, DIM, generator=g), dim=1)
    batch = torch.nn.functional.normalize(torch.randn(16, DIM, generator=g), dim=1)
    losses = []
    for crit in (mined, unmined, no_miner):
        with torch.no_grad():
            crit(stored, torch.arange(48) % CLASSES)
        losses.append(float(crit(batch, torch.arange(CLASSES).repeat_interleave(PER_CLASS))))
    # Against the memory, every pair (as with no miner at all); the miner's few hard pairs give another loss.
    assert losses[1] == pytest.approx(losses[2], rel=1e-6) and losses[0] != pytest.approx(losses[1], rel=1e-3)


@pytest.mark.parametrize(("method", "setting", "centred"), [
    ("xbm", "auto", True), ("oracle", "auto", True), ("xbn", "auto", False), ("axbn", "auto", False),
    ("ema", "auto", False), ("axbn_auto", "auto", False), ("xbm", "false", False), ("xbn", "true", True)])
def test_auto_centres_the_memory_whose_rows_are_stored_as_written(method, setting, centred):
    """`memory.center_gradient: auto` (the default): XBM's and the oracle's rows are stored as written, and
    uncentred XBM with the minibatch loss collapsed at batch 16 (docs/method.md); the mapped methods keep their
    gradient. An explicit true or false is taken as it is."""
    from xbn.memory.methods import centred_by_default

    crit = criterion(method, "all_pairs", f"memory.center_gradient={setting}")
    assert crit.memory.center_gradient is centred
    memory = load_params(None, [f"memory.method={method}", f"memory.center_gradient={setting}"]).memory
    assert memory.centred is centred  # what the model card says it trained with
    if setting == "auto" and method != "oracle":  # the library's rule is the pipeline's (the oracle is the trainer's)
        assert centred_by_default(method) is centred
    default = load_params(None, [f"memory.method={method}"]).memory.center_gradient
    assert default == "auto"  # params.yaml's own default, what a user who names only the method gets


def test_the_library_centres_xbm_unless_told_and_leaves_the_mapped_methods_alone():
    from pytorch_metric_learning.losses import ContrastiveLoss

    from xbn import cross_batch_memory

    assert cross_batch_memory(ContrastiveLoss(), 8, 32, "xbm").center_gradient is True
    assert cross_batch_memory(ContrastiveLoss(), 8, 32, "xbn").center_gradient is False
    assert cross_batch_memory(ContrastiveLoss(), 8, 32, "xbm", center_gradient=False).center_gradient is False
    with pytest.raises(ValueError, match="center_gradient='yes'"):
        cross_batch_memory(ContrastiveLoss(), 8, 32, "xbm", center_gradient="yes")
