"""The memory normalises its rows once per step for every distance of its loss and miner (`_SharedUnitRows`).
Nothing a user sees may change: the same mined pairs, loss, gradient and rows as pytorch-metric-learning's own
per-distance `F.normalize`."""

import pytest
import torch
from pytorch_metric_learning import losses, miners
from pytorch_metric_learning.distances import BaseDistance, LpDistance

from xbn.memory import BatchMoments, CrossBatchMemory

D, BATCH, SIZE = 24, 12, 100  # 100 rows, batches of 12: the queue wraps at a different offset every turn


def memory(moments, shared: bool) -> CrossBatchMemory:
    # The miner's LpDistance and the loss's CosineSimilarity both normalise the memory's rows.
    m = CrossBatchMemory(losses.SupConLoss(temperature=0.1), D, SIZE,
                         miner=miners.PairMarginMiner(pos_margin=0.2, neg_margin=0.9), moments=moments)
    if not shared:  # PML's own normalisation: drop the instance attribute, the class's method is back
        for sub in m.modules():
            if isinstance(sub, BaseDistance) and "normalize" in vars(sub):
                del sub.normalize
        m.shared_distances = 0
    return m


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    centres = torch.randn(10, D, generator=torch.Generator().manual_seed(0))
    y = torch.randperm(10, generator=g)[:3].repeat_interleave(4)
    x = centres[y] + (1 + step / 20) * torch.randn(BATCH, D, generator=g) + step / 10
    return torch.nn.functional.normalize(x, dim=1), y


@pytest.mark.parametrize("moments", [None, BatchMoments], ids=["xbm", "xbn"])
def test_shared_normalised_rows_give_pml_s_pairs_loss_gradient_and_rows(moments):
    ours = memory(moments() if moments else None, shared=True)
    reference = memory(moments() if moments else None, shared=False)
    assert (ours.shared_distances, reference.shared_distances) == (2, 0)
    mined = 0
    for step in range(40):  # 480 rows through a 100-row memory
        x, y = batch(step)
        results = []
        for m in (ours, reference):
            e = x.clone().requires_grad_()
            loss = m(e, y)
            loss.backward()
            assert e.grad is not None
            results.append((float(loss.detach()), e.grad, m.miner.num_pos_pairs + m.miner.num_neg_pairs))
        (loss_a, grad_a, pairs_a), (loss_b, grad_b, pairs_b) = results
        assert pairs_a == pairs_b
        assert loss_a == pytest.approx(loss_b, abs=1e-6)
        torch.testing.assert_close(grad_a, grad_b, rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.embedding_memory, reference.embedding_memory, rtol=0, atol=0)
        mined += pairs_a
    assert mined > 0


def test_only_the_memory_s_rows_inside_its_forward_are_shared():
    m = memory(BatchMoments(), shared=True)
    for step in range(3):
        m(*batch(step))
    rows = m.valid_rows()
    assert m.unit_rows_for(rows) is None  # outside a forward: the distance normalises as PML does
    distance = m.loss.distance
    torch.testing.assert_close(distance(rows[:5], rows), distance.__class__()(rows[:5], rows))


def test_a_forward_normalises_the_rows_once_for_the_miner_and_the_loss(monkeypatch):
    import xbn.memory.cross_batch as cross_batch

    m = memory(BatchMoments(), shared=True)
    m(*batch(0))
    calls = []
    normalise = cross_batch._normalise_rows
    monkeypatch.setattr(cross_batch, "_normalise_rows",
                        lambda rows, out: calls.append(len(rows)) or normalise(rows, out))
    m(*batch(1))
    assert calls == [2 * BATCH]  # the miner's call filled the copy, the loss's was handed it


def test_distances_that_do_not_use_the_l2_norm_keep_their_own():
    m = CrossBatchMemory(losses.ContrastiveLoss(distance=LpDistance(p=1)), D, SIZE,
                         miner=miners.PairMarginMiner(distance=LpDistance(p=1)))
    assert m.shared_distances == 0


def test_the_shipped_criterion_shares_its_loss_s_and_miner_s_normalisation():
    from pathlib import Path

    from xbn.config import load_params
    from xbn.training.criterion import build_criterion

    params = load_params(Path(__file__).resolve().parents[2] / "params.yaml")
    assert build_criterion(params, num_train_images=1000).memory.shared_distances == 2  # SupCon's, the miner's
