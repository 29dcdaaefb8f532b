"""Greedy coreset batches (Roth et al. 2020, ICML, Sec. 4.3; their `greedy_coreset_sampler`): from b* random
images pick P anchors by k-center greedy in the embedding space (each new anchor is the pool image farthest
from the anchors so far), so a batch spreads over the whole space; each anchor brings M-1 more images of its
class (SPC-n structure). Unlike theirs, the anchors are of distinct classes (a pool image of a class already in
the batch is never an anchor), and the min-distance vector starts from the first anchor (they start it from
each row's norm of squared distances)."""

from __future__ import annotations

import numpy as np

from xbn.data.samplers.embedded import EmbeddedBatchSampler


def k_center_greedy(points: np.ndarray, k: int, first: int, groups: np.ndarray | None = None) -> list[int]:
    """Row numbers of up to `k` centers: `first`, then repeatedly the point farthest (Euclidean) from its
    nearest center. With `groups`, points of a group that already has a center are never picked; fewer than
    `k` come back when the groups run out. Written out here: sklearn/faiss offer no k-center greedy."""
    n = len(points)
    taken = np.zeros(n, dtype=bool)
    nearest = np.full(n, np.inf)
    sq = np.einsum("ij,ij->i", points, points)
    centers, new = [], first
    while True:
        centers.append(new)
        taken |= (groups == groups[new]) if groups is not None else (np.arange(n) == new)
        if len(centers) == k or taken.all():
            return centers
        nearest = np.minimum(nearest, sq + sq[new] - 2 * (points @ points[new]))  # squared: same argmax
        new = int(np.argmax(np.where(taken, -np.inf, nearest)))


class GreedyCoresetBatchSampler(EmbeddedBatchSampler):
    name = "greedy_coreset"

    def _select(self, rng: np.random.Generator) -> np.ndarray:
        pool = self._image_pool(rng)
        classes = self._class_of[pool]
        anchors = pool[k_center_greedy(self.features(pool), self.classes_per_batch, int(rng.integers(len(pool))),
                                       classes)]
        chosen = list(self._class_of[anchors])
        if len(chosen) < self.classes_per_batch:  # the pool held too few classes: random ones make up the rest
            rest = np.setdiff1d(np.arange(len(self._groups)), chosen)
            chosen += list(rng.choice(rest, size=self.classes_per_batch - len(chosen), replace=False))
            anchors = np.concatenate([anchors, np.full(len(chosen) - len(anchors), -1)])
        batch = []
        for anchor, c in zip(anchors, chosen):
            members = self._groups[c]
            if anchor < 0:
                batch.append(self._draw(rng, members))
                continue
            others = members[members != anchor]
            m = self.samples_per_class - 1
            fill = rng.choice(others, size=m, replace=False) if len(others) >= m else \
                np.concatenate([rng.permutation(others), rng.choice(others, size=m - len(others))])
            batch.append(np.concatenate([[anchor], fill]))
        return np.concatenate(batch)
