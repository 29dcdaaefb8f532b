"""`EmbeddedBatchSampler`: the base of Roth et al.'s (2020, ICML, Sec. 4.3) embedding-space batch samplers.

It keeps a bank with the latest embedding of every training image (float32, CPU; their "storage"). Each batch
draws a pool of b* = `candidates` images at random and lets a subclass pick the batch from it by their
embeddings (greedy coreset, distance-distribution matching, Frechet distance). The batch keeps the SPC-n
structure (P classes x M images) so the pair losses and miners get positives.

The bank:
- starts with one embedding pass over the training set (eval transform, `fill`), as their `create_storage`;
  the trainer runs it before the first epoch, a resumed run takes the bank from the checkpoint instead;
- is refreshed by the training stream: the trainer calls `observe(indices, embeddings)` after every step
  (their `replace_storage_entries`);
- is read when each batch is drawn. The batch sampler runs in the training process, the DataLoader's workers
  only load images, so with `num_workers=0` a batch sees every step before it; with workers the loader has
  asked for `prefetch_factor x num_workers` batches ahead (2 per worker by default), and those were chosen
  from a bank that many steps older.

Roth et al. precompute a whole epoch of batches from the bank at the epoch start; choosing each batch when it
is asked for uses fresher embeddings and costs no more. Batches are a pure function of (seed, epoch, bank), and
the bank is in `state_dict` (the trainer's checkpoint), so a run resumed at an epoch boundary draws the same
batches. Data-parallel runs are refused by the trainer: every rank would need the same bank, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from xbn.data.sampler import ClassBalancedBatchSampler


class EmbeddedBatchSampler(ClassBalancedBatchSampler):
    """Subclasses implement `_select(rng) -> np.ndarray` (the batch's dataset indices)."""

    name = "embedded"

    def __init__(self, labels: Sequence[int] | np.ndarray, batch_size: int, samples_per_class: int, seed: int,
                 candidates: int = 1024, projection_dim: int = 0, trials: int = 0,
                 batches_per_epoch: int | None = None) -> None:
        super().__init__(labels, batch_size, samples_per_class, seed, batches_per_epoch)
        if candidates < batch_size:
            raise ValueError(f"candidates ({candidates}) must be at least the batch size ({batch_size})")
        if projection_dim < 0 or trials < 0:
            raise ValueError(f"projection_dim ({projection_dim}) and trials ({trials}) must be >= 0")
        self.num_images = len(labels)
        self.candidates, self.projection_dim, self.trials = candidates, projection_dim, trials
        self._class_of = np.full(self.num_images, -1)  # usable class number of each image (-1: skipped class)
        for c, members in enumerate(self._groups):
            self._class_of[members] = c
        self._usable = np.flatnonzero(self._class_of >= 0)
        self.bank: np.ndarray | None = None
        self._projection: np.ndarray | None = None

    # -- the bank -------------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.bank is not None

    def fill(self, embeddings: Any) -> None:
        """Set the whole bank: row i is the embedding of dataset image i."""
        bank = _as_numpy(embeddings)
        if bank.ndim != 2 or len(bank) != self.num_images:
            raise ValueError(f"the bank needs one embedding per training image ({self.num_images}), "
                             f"got shape {tuple(bank.shape)}")
        self.bank = np.array(bank, dtype=np.float32)  # a private copy

    def observe(self, indices: Any, embeddings: Any) -> None:
        """Store the latest embeddings of the images `indices` (a training step's batch)."""
        if self.bank is None:
            raise RuntimeError("observe() before fill(): the bank has no initial embeddings")
        self.bank[_as_numpy(indices).astype(np.int64)] = _as_numpy(embeddings)

    def state_dict(self) -> dict:
        import torch  # lazily: importing xbn.data stays free of torch

        return {"bank": torch.from_numpy(self.bank.copy()) if self.bank is not None else None}

    def load_state_dict(self, state: dict) -> None:
        bank = state.get("bank")
        if bank is None:
            self.bank = None
        else:
            self.fill(bank)

    def features(self, rows: np.ndarray) -> np.ndarray:
        """The bank rows the selection compares, randomly projected to `projection_dim` when set (Roth et al.'s
        `lowproj_dim`). The projection is fixed by the seed (theirs was redrawn every batch) with N(0, 1/k)
        entries, so distances keep their scale (Johnson-Lindenstrauss)."""
        assert self.bank is not None
        x = self.bank[rows].astype(np.float64)
        if self.projection_dim:
            if self._projection is None or self._projection.shape[0] != x.shape[1]:
                rng = np.random.default_rng([self.seed, 0x9E37])
                self._projection = rng.normal(0.0, self.projection_dim ** -0.5, (x.shape[1], self.projection_dim))
            x = x @ self._projection
        return x

    # -- pools ----------------------------------------------------------------------------------------------
    def _image_pool(self, rng: np.random.Generator) -> np.ndarray:
        """b* images drawn uniformly from the usable ones (fewer if the set is smaller)."""
        return rng.choice(self._usable, size=min(self.candidates, len(self._usable)), replace=False)

    def _group_pool(self, rng: np.random.Generator) -> np.ndarray:
        """b*/M random classes with M images each (SPC-structured, their `spc_batchfinder`), as (groups, M)."""
        k = min(self.candidates // self.samples_per_class, len(self._groups))
        classes = rng.choice(len(self._groups), size=k, replace=False)
        return np.stack([self._draw(rng, self._groups[c]) for c in classes])

    # -- iteration ------------------------------------------------------------------------------------------
    def _select(self, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError

    def __iter__(self) -> Iterator[list[int]]:
        if self.bank is None:
            raise RuntimeError(f"the {self.name} sampler needs its embedding bank: call fill() first")
        rng = np.random.default_rng([self.seed, self.epoch])
        for _ in range(self.batches_per_epoch):
            yield self._select(rng).tolist()  # drawn now, from the bank as it is now


SELECTIONS = ("best_of_m", "greedy")


class MatchingBatchSampler(EmbeddedBatchSampler):
    """DDM and FRD: a batch of P class groups from the SPC-structured pool whose embeddings match the pool's by
    a criterion (lower is better). `selection`:

    - `best_of_m` (Roth et al.'s procedure, the default): `candidate_batches` (m) random batches of P distinct
      pool groups, the one with the best criterion kept;
    - `greedy`: one group at a time, each time the pool group that improves the criterion most (the first at
      random; `trials` > 0 scores that many random groups per step). It reaches a much smaller distance than
      best-of-10 (tests/data/test_roth_samplers.py), a batch more unlike a random one than the paper's.

    Subclasses implement `_greedy(features, first, rng)` and `_best(features, candidates)`, the pool's
    features coming in group order (group g = rows g*M .. g*M+M-1)."""

    def __init__(self, *args, selection: str = "best_of_m", candidate_batches: int = 10, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}, got {selection!r}")
        if candidate_batches < 1:
            raise ValueError(f"candidate_batches must be >= 1, got {candidate_batches}")
        self.selection, self.candidate_batches = selection, candidate_batches

    def _greedy(self, features: np.ndarray, first: int, rng: np.random.Generator) -> list[int]:
        raise NotImplementedError

    def _best(self, features: np.ndarray, candidates: np.ndarray) -> int:
        raise NotImplementedError

    def _select(self, rng: np.random.Generator) -> np.ndarray:
        pool = self._group_pool(rng)
        features = self.features(pool.ravel())
        if self.selection == "greedy":
            return pool[self._greedy(features, int(rng.integers(len(pool))), rng)].ravel()
        candidates = random_group_batches(len(pool), self.classes_per_batch, self.candidate_batches, rng)
        return pool[candidates[self._best(features, candidates)]].ravel()


def random_group_batches(num_groups: int, k: int, m: int, rng: np.random.Generator) -> np.ndarray:
    """m candidate batches, each k distinct groups of the pool drawn uniformly: (m, min(k, num_groups))."""
    k = min(k, num_groups)
    return np.argsort(rng.random((m, num_groups)), axis=1)[:, :k]


def group_rows(groups: np.ndarray, group_size: int) -> np.ndarray:
    """The pool rows of each candidate's groups: (m, k) group numbers -> (m, k * group_size) rows."""
    return (groups[..., None] * group_size + np.arange(group_size)).reshape(len(groups), -1)


def pairwise_distances(x: np.ndarray) -> np.ndarray:
    """Euclidean distance matrix (float64, zero diagonal), through one BLAS product (scipy's `cdist` loops in
    C without BLAS: ten times slower for a 1024 x 512 pool)."""
    sq = np.einsum("ij,ij->i", x, x)
    d2 = sq[:, None] + sq[None, :] - 2 * (x @ x.T)
    np.fill_diagonal(d2, 0.0)
    return np.sqrt(np.clip(d2, 0.0, None))


def _as_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor (any device or dtype)
        return value.detach().float().cpu().numpy()
    return np.asarray(value)
