"""The contrastive loss of the official XBM code (Wang et al. 2020, research-xbm `ContrastiveLoss`), on PML's
`ContrastiveLoss`: cosine similarity s, each positive pair costs 1 - s and each negative pair s - 0.5 when
above 0.5, summed over every anchor's pairs and divided by the batch. Unlike SupCon on mined pairs it has no
flat region while any positive is not yet identical: a batch pulled into one point still pays for its
negatives. What PML lacks, written here: the reduction (a sum over pairs divided by the number of anchors;
PML's reducers average over pairs)."""

from __future__ import annotations

from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.losses import ContrastiveLoss
from pytorch_metric_learning.reducers import SumReducer


class XBMContrastiveLoss(ContrastiveLoss):
    def __init__(self, pos_margin: float = 1.0, neg_margin: float = 0.5):
        super().__init__(pos_margin=pos_margin, neg_margin=neg_margin, distance=CosineSimilarity(),
                         reducer=SumReducer())

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        losses = super().compute_loss(embeddings, labels, indices_tuple, ref_emb, ref_labels)
        for term in losses.values():
            term["losses"] = term["losses"] / len(embeddings)
        return losses
