"""The official XBM code's contrastive loss (`loss.name: XBMContrastiveLoss`), against a hand computation: each
positive pair costs 1 - s, each negative pair above s = 0.5 costs s - 0.5 (the official code adds s: the same
gradient, 0.5 more per such pair), summed over all pairs of every anchor and divided by the batch."""

from __future__ import annotations

import torch

from xbn.losses import build_loss
from xbn.memory import CrossBatchMemory


def hand(embeddings, labels, ref, ref_labels, drop_self: bool):
    s = embeddings @ ref.T
    total = torch.zeros(())
    for i in range(len(embeddings)):
        for j in range(len(ref)):
            if drop_self and i == j:
                continue
            if labels[i] == ref_labels[j]:
                total = total + (1 - s[i, j])
            elif s[i, j] > 0.5:
                total = total + (s[i, j] - 0.5)
    return total / len(embeddings)


def unit(n, d=8, seed=0):
    return torch.nn.functional.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=1)


def test_the_batch_loss_matches_the_hand_computation():
    loss = build_loss("XBMContrastiveLoss")
    e, y = unit(12), torch.arange(12) // 3
    e = e + 0.6 * e[:1]  # some negatives above 0.5
    e = torch.nn.functional.normalize(e, dim=1)
    assert torch.allclose(loss(e, y), hand(e, y, e, y, drop_self=True), atol=1e-6)


def test_against_a_memory_it_is_summed_over_every_stored_row_and_divided_by_the_batch():
    memory = CrossBatchMemory(build_loss("XBMContrastiveLoss"), 8, memory_size=40)
    old, old_y = unit(24, seed=1), torch.arange(24) % 5
    memory(old, old_y)  # 24 rows stored, then the batch is enqueued after them
    e, y = unit(8, seed=2), torch.arange(8) % 5
    got = memory(e, y)
    ref, ref_y = torch.cat([old, e]), torch.cat([old_y, y])
    s = e @ ref.T
    total = torch.zeros(())
    for i in range(8):
        for j in range(len(ref)):
            if j == 24 + i:  # the batch's own row: PML removes the self-comparison
                continue
            if y[i] == ref_y[j]:
                total = total + (1 - s[i, j])
            elif s[i, j] > 0.5:
                total = total + (s[i, j] - 0.5)
    assert torch.allclose(got, total / 8, atol=1e-5)
