"""rho-regularization (Roth et al. 2020, "Revisiting Training Strategies and Generalization Performance in Deep
Metric Learning", ICML, Sec. 5): with probability `p_switch` a mined negative is replaced by another positive of
its anchor, so the ranking loss also pushes same-class samples apart. That keeps more directions of the embedding
space in use (a flatter singular value spectrum, a lower rho spectral decay) and generalizes better.

`RhoRegularizedMiner` wraps any PML miner (or, without one, all triplets: B x M x M candidates against a
memory of M rows, so configure a miner there) and rewrites its output:

- triplets (a, p, n) become (a, a, p'), p' a positive of a other than a itself, as Roth's reference code
  writes them (`rho_distance` miner): d(a, a) = 0, so a triplet loss [d(a, a) - d(a, p') + m]+ only pushes p'
  away from a, up to the margin. The form (a, p, p') would cancel that push: it is as often written with p
  and p' the other way round, and with p' = p it carries no gradient at all.
  Against a cross-batch memory (the reference rows are not the batch) the anchor's own row is dropped by
  PML's `CrossBatchMemory` (its self-comparison removal), so there the triplet becomes (a, p, p') with p' other
  than p where a has another positive: the closest form that survives; the paper studies no memory.
- pairs (a1, p, a2, n): with probability `p_switch` per anchor, one of its negative pairs (a2, n), drawn at
  random, becomes (a2, p'), p' a positive of a2 other than a2 itself, still passed as a negative pair, so pair
  losses push it away. Per anchor, not per pair: Roth et al. switch the negative of one triplet per anchor,
  and a pair miner returns far more negative pairs than positive ones, so switching each negative pair with
  probability p would turn most of an anchor's positives into negatives (measured: R@1 0.31 on the glyph
  default at p = 0.2, no better than untrained).

A tuple whose anchor has no positive to switch to is kept as it is.

With `pairs=True` (the loss is a pair loss: PML's `GenericPairLoss`, e.g. SupCon, contrastive, multi-similarity)
triplets are turned into pairs first, and a switched pair (a2, p') is taken out of the positive pairs: a pair
loss cannot hold one pair as both (PML asserts on it), and rho means p' is pushed away from a2 at this step.

The draws come from a seeded `torch.Generator` (CPU) kept in `state_dict`; `last_switched` counts the tuples
switched at the last call.
"""

from __future__ import annotations

import torch
from pytorch_metric_learning.miners import BaseMiner
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
from torch import nn

from xbn.losses.miners import positive_negative_masks


class RhoRegularizedMiner(BaseMiner):
    def __init__(self, miner: nn.Module | None, p_switch: float, seed: int = 0, pairs: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.pairs = pairs
        if not 0.0 <= p_switch <= 1.0:
            raise ValueError(f"p_switch must lie in [0, 1], got {p_switch}")
        self.miner, self.p_switch = miner, float(p_switch)
        self.generator = torch.Generator().manual_seed(int(seed))
        self.last_switched = 0

    def get_extra_state(self):
        return {"generator": self.generator.get_state()}

    def set_extra_state(self, state):
        self.generator.set_state(state["generator"])

    def mine(self, embeddings, labels, ref_emb, ref_labels):
        if self.miner is not None:
            tuples = self.miner(embeddings, labels, ref_emb, ref_labels)
        elif self.pairs:  # PML's own defaults: all pairs for pair losses, all triplets for the others
            tuples = lmu.get_all_pairs_indices(labels, ref_labels)
        else:  # `ref_labels is labels` drops the diagonal
            tuples = lmu.get_all_triplets_indices(labels, ref_labels)
        if len(tuples) not in (3, 4):
            raise ValueError(f"rho-regularization needs (a, p, n) triplets or (a1, p, a2, n) pairs; the miner "
                             f"returned a tuple of {len(tuples)} index tensors")
        if self.pairs and len(tuples) == 3:
            tuples = lmu.convert_to_pairs(tuples, labels, ref_labels)
        anchors, negatives = (tuples[0], tuples[2]) if len(tuples) == 3 else (tuples[2], tuples[3])
        against_batch = ref_emb is embeddings  # PML's BaseMiner passes the batch itself when there is no memory
        avoid = tuples[1] if len(tuples) == 3 and not against_batch else None
        idx = self._triplets_to_switch(anchors) if len(tuples) == 3 else self._pairs_to_switch(anchors)
        self.last_switched = 0
        if not len(idx):
            return tuples
        positives, _ = positive_negative_masks(embeddings, labels, ref_emb, ref_labels)
        replacement, ok = self._draw_positive(positives, anchors[idx], None if avoid is None else avoid[idx])
        negatives = negatives.clone()
        negatives[idx[ok]] = replacement[ok]
        self.last_switched = int(ok.sum())
        if len(tuples) == 3:
            positives_out = tuples[1]
            if against_batch:  # (a, a, p'): the anchor is its own positive, p' the switched negative
                positives_out = positives_out.clone()
                positives_out[idx[ok]] = anchors[idx[ok]]
            return tuples[0], positives_out, negatives
        a1, p = tuples[0], tuples[1]
        if self.pairs:  # a switched pair is now a negative one only
            width = positives.shape[1]
            kept = ~torch.isin(a1 * width + p, anchors[idx[ok]] * width + replacement[ok])
            a1, p = a1[kept], p[kept]
        return a1, p, anchors, negatives

    def _triplets_to_switch(self, anchors: torch.Tensor) -> torch.Tensor:
        """Each triplet with probability p_switch (positions into the tuples)."""
        switch = torch.rand(len(anchors), generator=self.generator).to(anchors.device) < self.p_switch
        return torch.where(switch)[0]

    def _pairs_to_switch(self, anchors: torch.Tensor) -> torch.Tensor:
        """For each anchor with a negative pair, with probability p_switch, one of its negative pairs drawn
        uniformly (positions into the tuples)."""
        if not len(anchors):
            return anchors
        order = torch.randperm(len(anchors), generator=self.generator).to(anchors.device)
        first = torch.full((int(anchors.max()) + 1,), len(anchors), dtype=torch.long, device=anchors.device)
        first.scatter_reduce_(0, anchors[order], torch.arange(len(anchors), device=anchors.device), reduce="amin")
        chosen = order[first[first < len(anchors)]]  # a random negative pair of every anchor that has one
        switch = torch.rand(len(chosen), generator=self.generator).to(anchors.device) < self.p_switch
        return chosen[switch]

    def _draw_positive(self, positives: torch.Tensor, anchors: torch.Tensor, avoid: torch.Tensor | None):
        """A uniform positive column of each anchor's row (other than `avoid` where the row has another one),
        and whether the row had any positive. Written by hand: it indexes the flat sorted list of positive
        pairs (O(P + k)), never a [k, M] mask, so a large memory and many triplets stay cheap."""
        width = positives.shape[1]
        rows, cols = torch.where(positives)  # row-major: sorted by row, then column
        counts = torch.bincount(rows, minlength=positives.shape[0])
        offsets = torch.cumsum(counts, 0) - counts
        n, start = counts[anchors], offsets[anchors]
        skip = torch.zeros_like(anchors, dtype=torch.bool)
        rank = torch.zeros_like(anchors)
        if avoid is not None and len(rows):
            keys = rows * width + cols
            at = torch.searchsorted(keys, anchors * width + avoid).clamp(max=len(keys) - 1)
            skip = (keys[at] == anchors * width + avoid) & (n > 1)
            rank = at - start
        choices = n - skip.long()
        u = torch.rand(len(anchors), generator=self.generator).to(anchors.device)
        r = torch.minimum((u * choices).long(), (choices - 1).clamp(min=0))
        r = r + (skip & (r >= rank)).long()
        ok = n > 0
        picked = cols[(start + r).clamp(max=max(len(cols) - 1, 0))] if len(cols) else torch.zeros_like(anchors)
        return picked, ok


__all__ = ["RhoRegularizedMiner"]
