"""Triplet miners of Roth et al. 2020 that pytorch-metric-learning lacks: random and soft-hard.

K. Roth, T. Milbich, S. Sinha, P. Gupta, B. Ommer, J. P. Cohen, "Revisiting Training Strategies and
Generalization Performance in Deep Metric Learning", ICML 2020 (batch miners "random" and "softhard"). The other
two miners of that study come from PML: semi-hard is `TripletMarginMiner(type_of_triplets="semihard")`,
distance-weighted is `DistanceWeightedMiner`.

Both are PML miners (`BaseMiner`, the base class PML 2.9 has in place of the older `BaseTupleMiner`): they take
`(embeddings, labels, ref_emb, ref_labels)` and return `(anchors, positives, negatives)`, so they work on the
minibatch and against a cross-batch memory alike. Their draws come from their own seeded `torch.Generator`
(CPU), whose state is in `state_dict`, so a resumed run mines the same triplets; every rank of a DDP run sees the
same gathered batch and draws the same triplets.
"""

from __future__ import annotations

import torch
from pytorch_metric_learning.miners import BaseMiner


def positive_negative_masks(embeddings: torch.Tensor, labels: torch.Tensor, ref_emb: torch.Tensor,
                            ref_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positives, negatives) boolean [N, M]: same / different label, the anchor's own row never a positive.

    Written by hand because against a memory the batch is already enqueued in `ref_emb` (PML's
    CrossBatchMemory), and PML only drops (a, own row) *after* mining, which would silently cost a
    one-triplet-per-anchor miner the anchor. The own row is recognised as an identical row of the same label
    (checked on the positive pairs only, O(P d)); an exact duplicate image is excluded with it, harmlessly.
    """
    same = labels[:, None] == ref_labels[None, :]
    a, p = torch.where(same)
    own = (embeddings[a] == ref_emb[p]).all(dim=1)
    positives = same.clone()
    positives[a[own], p[own]] = False
    return positives, ~same


class SeededMiner(BaseMiner):
    """A PML miner with its own seeded generator, kept in `state_dict`."""

    def __init__(self, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.seed = int(seed)
        self.generator = torch.Generator().manual_seed(self.seed)

    def get_extra_state(self):
        return {"generator": self.generator.get_state()}

    def set_extra_state(self, state):
        self.generator.set_state(state["generator"])

    def uniform(self, *shape: int, device: torch.device) -> torch.Tensor:
        return torch.rand(*shape, generator=self.generator).to(device)

    def pick(self, mask: torch.Tensor) -> torch.Tensor:
        """One column per row, uniformly among the row's True entries (argmax of masked uniforms)."""
        scores = self.uniform(*mask.shape, device=mask.device)
        return scores.masked_fill(~mask, -1.0).argmax(dim=1)

    def far_is_large(self, embeddings: torch.Tensor, ref_emb: torch.Tensor) -> torch.Tensor:
        """The distance matrix oriented so that larger means farther (similarities are negated)."""
        mat = self.distance(embeddings, ref_emb)
        return -mat if self.distance.is_inverted else mat


class RandomTripletMiner(SeededMiner):
    """Roth's "random" miner: one triplet per anchor, its positive (p != a) and negative drawn uniformly.

    Every batch row that has a positive and a negative in the reference set is an anchor exactly once (the
    paper's per-anchor sampling; a row of a class with no other sample has none and is left out).
    `num_triplets` instead draws that many triplets uniformly from the set of all valid triplets, with
    replacement, as Roth's reference code does (`random.sample` of batch-size triplets): an anchor with
    probability proportional to its number of (positive, negative) combinations, so some anchors get several
    triplets and others none.
    """

    def __init__(self, num_triplets: int | None = None, seed: int = 0, **kwargs):
        super().__init__(seed=seed, **kwargs)
        if num_triplets is not None and num_triplets < 1:
            raise ValueError(f"num_triplets must be positive, got {num_triplets}")
        # Not `self.num_triplets`: PML's BaseMiner overwrites that attribute with the count of its last output.
        self.sample_size = num_triplets

    def mine(self, embeddings, labels, ref_emb, ref_labels):
        positives, negatives = positive_negative_masks(embeddings, labels, ref_emb, ref_labels)
        if self.sample_size is None:
            anchors = torch.where(positives.any(1) & negatives.any(1))[0]
        else:
            weights = positives.sum(1).double() * negatives.sum(1).double()
            if weights.sum() == 0:
                anchors = torch.empty(0, dtype=torch.long, device=labels.device)
            else:
                anchors = torch.multinomial(weights.cpu(), self.sample_size, replacement=True,
                                            generator=self.generator).to(labels.device)
        if not len(anchors):
            return anchors, anchors.clone(), anchors.clone()
        return anchors, self.pick(positives[anchors]), self.pick(negatives[anchors])


class SoftHardMiner(SeededMiner):
    """Roth's "softhard" miner: one triplet per anchor that has a positive and a negative.

    Hard positives are positives farther than the anchor's closest negative; hard negatives are negatives
    closer than its farthest positive. The positive is drawn uniformly among the hard positives (among all
    positives when there is none), the negative likewise among the hard negatives.
    """

    def mine(self, embeddings, labels, ref_emb, ref_labels):
        positives, negatives = positive_negative_masks(embeddings, labels, ref_emb, ref_labels)
        anchors = torch.where(positives.any(1) & negatives.any(1))[0]
        positives, negatives = positives[anchors], negatives[anchors]
        d = self.far_is_large(embeddings[anchors], ref_emb)
        inf = torch.tensor(float("inf"), dtype=d.dtype, device=d.device)
        farthest_positive = torch.where(positives, d, -inf).amax(1, keepdim=True)
        closest_negative = torch.where(negatives, d, inf).amin(1, keepdim=True)
        hard_pos = positives & (d > closest_negative)
        hard_neg = negatives & (d < farthest_positive)
        pos_pool = torch.where(hard_pos.any(1, keepdim=True), hard_pos, positives)
        neg_pool = torch.where(hard_neg.any(1, keepdim=True), hard_neg, negatives)
        return anchors, self.pick(pos_pool), self.pick(neg_pool)


__all__ = ["RandomTripletMiner", "SeededMiner", "SoftHardMiner", "positive_negative_masks"]
