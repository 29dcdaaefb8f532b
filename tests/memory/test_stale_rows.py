"""What issue 42 added to the memory to study its staleness: each row's dataset index (exclude_self), the
batch's rows kept attached (attach_batch), the stored inputs of tracked slots, the drift-free oracle and the
drift measurement (seed 000 Sec. 5, Fig. 2)."""

import pytest
import torch
from pytorch_metric_learning.losses import ContrastiveLoss
from torch import nn

from xbn.config import load_params
from xbn.memory import BatchMoments, CrossBatchMemory
from xbn.training.criterion import memory_start_iteration
from xbn.training.diagnostics import memory_drift, summarize_memory_drift
from tests_support import ROOT

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _views(n: int, seed: int) -> torch.Tensor:
    """Normalised images whose pixels are whole uint8 values, as ToTensor + Normalize make them."""
    pixels = torch.randint(0, 256, (n, 3, 8, 8), generator=torch.Generator().manual_seed(seed)).float() / 255
    return (pixels - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


class FixedEmbedder(nn.Module):
    """A fixed random projection of the pixels, unit norm: a stand-in 'current model'."""

    def __init__(self, dim: int = 16, seed: int = 0):
        super().__init__()
        self.proj = torch.randn(3 * 8 * 8, dim, generator=torch.Generator().manual_seed(seed))

    def forward(self, images):
        return nn.functional.normalize(images.flatten(1) @ self.proj, dim=1)


class Recording(nn.Module):
    """The inner loss, keeping the indices tuple it was given."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.seen = inner, None

    def forward(self, embeddings, labels, indices_tuple=None, ref_emb=None, ref_labels=None):
        self.seen = indices_tuple
        return self.inner(embeddings, labels, indices_tuple, ref_emb, ref_labels)


def test_stored_views_decode_to_the_exact_input():
    memory = CrossBatchMemory(ContrastiveLoss(), 16, memory_size=8)
    stored = memory.track_inputs(torch.arange(8), MEAN, STD)
    images, model = _views(4, 0), FixedEmbedder()
    memory.set_batch(torch.arange(4), images)
    memory(model(images), torch.tensor([0, 0, 1, 1]))
    torch.testing.assert_close(stored.decode(torch.arange(4)), images, rtol=0, atol=1e-6)
    assert stored.valid(memory.num_valid).tolist() == [0, 1, 2, 3]


def test_exclude_self_drops_every_pair_with_an_earlier_view_of_the_anchors_image():
    def mined(exclude_self: bool):
        memory = CrossBatchMemory(ContrastiveLoss(), 16, memory_size=16, exclude_self=exclude_self)
        memory.loss = loss = Recording(memory.loss)  # after PML's check of the loss's class name
        model, labels, images = FixedEmbedder(), torch.tensor([0, 0, 1, 1]), torch.arange(4)
        for seed in (0, 1):  # the same four images, two views each
            memory.set_batch(images, _views(4, seed))
            memory(model(_views(4, seed)), labels)
        a1, p, a2, n = loss.seen
        return {(int(a), int(r)) for a, r in zip(a1, p)}, {(int(a), int(r)) for a, r in zip(a2, n)}

    positives, negatives = mined(False)
    # Anchor i of the second batch (slot 4 + i) meets slot i, its own image's first view, as a positive.
    assert {(i, i) for i in range(4)} <= positives
    kept_positives, kept_negatives = mined(True)
    assert kept_positives == {(a, r) for a, r in positives if r % 4 != a}
    assert kept_negatives == negatives  # a negative is never of the anchor's own image (same label)
    assert (0, 1) in kept_positives and (0, 5) in kept_positives  # other images of the class stay


def test_attached_batch_rows_double_the_in_batch_gradient():
    # A symmetric pair loss over a memory holding only the batch: each pair appears as (i, j) and (j, i); PML's
    # detached memory gives each appearance's gradient to its anchor only, the attached rows to both sides.
    def gradient(attach: bool):
        embeddings = FixedEmbedder()(_views(6, 0)).requires_grad_(True)
        memory = CrossBatchMemory(ContrastiveLoss(pos_margin=0.0, neg_margin=2.0), 16, memory_size=32,
                                  attach_batch=attach)
        loss = memory(embeddings, torch.tensor([0, 0, 0, 1, 1, 1]))
        loss.backward()
        return loss.detach(), embeddings.grad

    loss_detached, detached = gradient(False)
    loss_attached, attached = gradient(True)
    assert loss_attached == pytest.approx(float(loss_detached))
    assert detached.abs().sum() > 0
    torch.testing.assert_close(attached, 2 * detached)


def test_the_oracle_rewrites_every_row_as_the_current_models_embedding_of_its_view():
    memory = CrossBatchMemory(ContrastiveLoss(), 16, memory_size=12)
    memory.track_inputs(torch.arange(12), MEAN, STD)
    old = FixedEmbedder(seed=0)
    for step in range(4):  # 16 rows into 12 slots: the ring has wrapped
        images = _views(4, step)
        memory.iteration = step
        memory.set_batch(torch.arange(4 * step, 4 * step + 4), images)
        memory(old(images), torch.tensor([0, 0, 1, 1]))
    new = FixedEmbedder(seed=1)
    assert memory.reembed(new, iteration=9) == 12
    # Slots 0-3 hold the last batch's views (steps 3), 4-11 those of steps 1 and 2.
    views = torch.cat([_views(4, 3), _views(4, 1), _views(4, 2)])
    torch.testing.assert_close(memory.embedding_memory, new(views), rtol=0, atol=1e-5)
    rows = memory.embedding_memory.double()
    mean, std = memory.memory_moments()
    torch.testing.assert_close(mean, rows.mean(0))
    torch.testing.assert_close(std, rows.std(0, unbiased=False))
    assert memory.stored.written_at.tolist() == [9] * 12


@pytest.mark.parametrize("method", ["xbm", "xbn"])
def test_drift_is_zero_for_an_unchanged_model_and_the_map_moves_rows_away(method):
    moments = BatchMoments() if method == "xbn" else None
    memory = CrossBatchMemory(ContrastiveLoss(), 16, memory_size=16, moments=moments)
    memory.track_inputs(torch.arange(0, 16, 2), MEAN, STD)  # every other slot
    model = FixedEmbedder()
    for step in range(4):
        images = _views(4, step)
        memory.iteration = step
        memory.set_batch(None, images)
        memory(model(images), torch.tensor([0, 0, 1, 1]))
    row = memory_drift(memory, model, iteration=4, rows=256)
    assert row["memory_rows_checked"] == 8
    assert row["stored_drift_max"] < 1e-5 and row["stored_cosine"] == pytest.approx(1.0, abs=1e-6)
    assert row["memory_age"] == pytest.approx(4 - (0 + 1 + 2 + 3) / 4)
    if method == "xbm":
        assert row["mapped_drift_max"] == row["stored_drift_max"] and "scale_min" not in row
    else:  # three maps onto other batches' moments moved the older rows off the (unchanged) model's embeddings
        assert row["mapped_drift_mean"] > 0.01 and row["scale_min"] <= row["scale_median"] <= row["scale_max"]
    assert row["batch_mean_noise"] > 0
    summary = summarize_memory_drift([{"iteration": 1}, row])
    assert summary["checks"] == 1 and summary["mapped_closer_fraction"] == 0.0


def test_the_late_start_counts_steps_after_the_warm_up():
    params = load_params(ROOT / "params.yaml", ["train.warmup_epochs=2", "memory.delay_steps=1000"])
    assert memory_start_iteration(params, steps_per_epoch=30) == 1060


def test_the_summary_says_whether_the_map_brought_the_rows_nearer():
    from xbn.stages.summary import memory_drift_line

    drift = {"checks": 27, "stored_drift_mean": 0.034, "mapped_drift_mean": 0.184, "stored_cosine": 0.9992,
             "mapped_cosine": 0.9821, "memory_age": 7.4, "mapped_closer_fraction": 0.0}
    line = memory_drift_line(drift, "xbn")
    assert "stored rows 0.034" in line and "xbn's map left them farther (0.184" in line and "in 0%" in line
    xbm = memory_drift_line({**drift, "mapped_drift_mean": 0.034, "mapped_cosine": 0.9992}, "xbm")
    assert "map" not in xbm and "7 steps old" in xbm
