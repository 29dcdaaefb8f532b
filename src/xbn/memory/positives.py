"""The one rule for mined pairs without a positive, shared by the minibatch loss (`training.criterion`) and the
loss against the cross-batch memory (`memory.cross_batch`), written by hand: PML's losses rightly return 0 on
such a tuple, which is what a solved batch looks like, but with a pair-margin miner it is what a collapse looks
like too."""

from __future__ import annotations

from collections.abc import Callable

from pytorch_metric_learning.losses import NTXentLoss, SupConLoss
from torch import nn

# What `with_positive` counts: steps with a pair miner, steps that mined no pair at all, steps that mined no
# positive, and those of them whose loss was taken over all pairs instead.
MINING_COUNTS = ("steps", "no_pair", "no_positive", "all_pairs")


def needs_positive(loss: nn.Module) -> bool:
    """SupCon and NT-Xent take their loss over each anchor's positives: mined pairs without a positive give
    them a loss of exactly 0 and no gradient."""
    return isinstance(loss, (SupConLoss, NTXentLoss))


def with_positive(pairs: tuple | None, all_pairs: Callable[[], tuple | None], needs: bool,
                  counts: dict[str, int]) -> tuple | None:
    """The pairs the loss is taken over. Negatives inside the miner's margin but no positive beyond it means the
    embeddings have collapsed (every positive pair within loss.miner_params.pos_margin), not a solved batch: a
    loss that `needs` a positive would give exactly 0 and no gradient, and the collapse would never end, so
    the loss is taken over `all_pairs()` instead. Counts the step into `counts` (MINING_COUNTS)."""
    if pairs is None or len(pairs) != 4:  # no miner, or a triplet miner: nothing to count or repair
        return pairs
    positives, negatives = len(pairs[0]), len(pairs[2])
    counts["steps"] += 1
    counts["no_pair"] += positives + negatives == 0
    counts["no_positive"] += positives == 0
    if positives == 0 and negatives and needs:
        counts["all_pairs"] += 1
        return all_pairs()
    return pairs
