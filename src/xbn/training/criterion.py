"""The training criterion, assembled from params: the ranking loss and its miner (`xbn.losses`), rho, MemVir,
the Intra-Batch MPN loss, and the cross-batch memory with its moment estimator (`xbn.memory`), gathered across
ranks under data parallelism."""

from __future__ import annotations

import os

import numpy as np
import torch
from pytorch_metric_learning.losses import GenericPairLoss
from torch import nn

from xbn.config import ConfigError, Params
from xbn.losses import build_loss, build_miner
from xbn.losses.memvir import MemVir
from xbn.losses.mpn import IntraBatchLoss
from xbn.losses.rho import RhoRegularizedMiner
from xbn.memory import CrossBatchMemory, cross_batch_memory
from xbn.memory.positives import MINING_COUNTS, needs_positive, with_positive
from xbn.models.mpn import MessagePassingNetwork
from xbn.training.figures import StepFigures
from xbn.utils import distributed

__all__ = ["Criterion", "available_memory", "build_criterion", "build_mpn_loss",
           "check_memory_fits", "memory_rows", "memory_start_iteration"]


def memory_rows(size: float, num_train_images: int, batch_size: int) -> int:
    """`memory.size` <= 1 is a fraction of the training set, above 1 a row count; never below one batch."""
    rows = round(size * num_train_images) if size <= 1 else int(size)
    return max(rows, batch_size)


def available_memory() -> int:
    """Bytes this machine can allocate now without swapping: MemAvailable (free + reclaimable cache), or the
    free pages where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory_fits(size: float, rows: int, embedding_dim: int, num_train_images: int) -> None:
    """Refuse (ConfigError naming memory.size) a memory whose float32 rows and int64 labels would not fit in
    the available memory, before anything is allocated (it is built in host memory first)."""
    need, have = rows * (embedding_dim * 4 + 8), available_memory()
    if need > have:
        raise ConfigError(
            f"memory.size={size:g} gives {rows} rows x {embedding_dim} dims x 4 bytes (+ 8 for each label) = "
            f"{_bytes(need)}, more than the {_bytes(have)} of memory available: lower memory.size (<= 1 is a "
            f"fraction of the {num_train_images} training images, above 1 a row count)")


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


class Criterion(nn.Module):
    """loss(embeddings, labels) for one training step.

    Without a memory it is the ranking loss on the minibatch's mined pairs. With one, the batch is enqueued and
    the loss is taken against the whole memory (XBM); from `start_iteration` on only (`memory.start`), and with the minibatch
    loss added when `add_batch_loss` (XBM*).

    With `mpn_loss` (Intra-Batch, `model.mpn`) the MPN's cross-entropies replace the minibatch ranking loss;
    a memory method then adds its cross-batch ranking loss on the backbone embeddings, which are what the
    memory stores and what inference uses (the MPN itself sees the current batch only).

    Under data parallelism each rank passes its slice of the global batch; the slices are gathered in rank
    order, so the loss, the miner and the memory (hence AXBN's R = r/|B|) all see the global batch, and every
    rank's memory holds the same rows in the same order. Each rank's gradient flows only through its own
    rows; they are scaled by the world size so that DDP's averaging over ranks gives the single-process
    gradient, while the returned loss keeps the single-process value (the same on every rank).
    """

    def __init__(self, loss: nn.Module, miner: nn.Module | None, memory: CrossBatchMemory | None = None,
                 start_iteration: int = 0, add_batch_loss: bool = False,
                 mpn_loss: IntraBatchLoss | None = None, no_positive: str = "all_pairs"):
        super().__init__()
        self.loss, self.miner, self.memory = loss, miner, memory
        self.mpn_loss = mpn_loss
        self.start_iteration, self.add_batch_loss = start_iteration, add_batch_loss
        self.iteration = 0
        # loss.no_positive: mined pairs without a positive give SupCon and NT-Xent exactly 0 (`with_positive`).
        self.repair_no_positive = no_positive == "all_pairs" and needs_positive(loss)
        self.mining = dict.fromkeys(MINING_COUNTS, 0)
        self.figures = StepFigures()

    # Mining of the minibatch loss's steps since the trainer last read them (`take_mining`): steps that mined,
    # steps whose miner found no positive pair, and those of them that fell back to all pairs.
    mining: dict[str, int]

    def take_mining(self) -> dict[str, int]:
        """The minibatch path's counts (MINING_COUNTS) and the memory path's (`memory_` + each, and the steps
        whose memory loss was exactly 0: one read of the device) since the last call."""
        counts = self.mining
        self.mining = dict.fromkeys(MINING_COUNTS, 0)
        if self.memory is not None:
            counts = {**counts, **{f"memory_{k}": v for k, v in self.memory.take_mining().items()},
                      "memory_zero_loss": self.figures.take_zero_steps()}
        return counts

    def get_extra_state(self):
        return {"iteration": self.iteration}

    def set_extra_state(self, state):
        self.iteration = int(state["iteration"])

    def batch_loss(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pairs = self.miner(embeddings, labels) if self.miner is not None else None
        pairs = with_positive(pairs, lambda: None, self.repair_no_positive, self.mining)
        return self.loss(embeddings, labels, pairs)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor, sources: torch.Tensor | None = None,
                inputs: torch.Tensor | None = None) -> torch.Tensor:
        """`sources`: the batch's dataset indices (`memory.exclude_self`); `inputs`: its images, kept for the
        memory's tracked slots (the oracle and the drift measurement; one process only)."""
        embeddings = embeddings.float()  # the memory and its statistics stay float32 under autocast
        if (world_size := distributed.world_size()) > 1:
            embeddings = distributed.gather_rows(distributed.scale_grad(embeddings, world_size))
            labels = distributed.gather_rows(labels)
            sources = None if sources is None else distributed.gather_rows(sources)
            inputs = None
        memory = self.memory if self.iteration >= self.start_iteration else None
        use_memory = memory is not None
        self.iteration += 1
        if memory is not None:
            memory.set_batch(sources, inputs)
        if self.mpn_loss is not None:  # Intra-Batch replaces the batch ranking loss; a memory loss adds to it
            loss = self.mpn_loss(embeddings, labels)
            return loss + self.memory_loss(embeddings, labels) if use_memory else loss
        if not use_memory:
            return self.batch_loss(embeddings, labels)
        return self.memory_loss(embeddings, labels)

    def memory_loss(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        assert self.memory is not None  # forward calls it only with a memory
        self.memory.iteration = self.iteration  # named if the memory's statistics turn non-finite
        loss = self.memory(embeddings, labels)
        batch_loss = self.batch_loss(embeddings, labels) if self.add_batch_loss else None
        self.figures.add(self.memory, embeddings, loss, batch_loss)
        return loss if batch_loss is None else loss + batch_loss

    def diagnostics(self) -> dict[str, float]:
        """The memory's last statistics and the memory path's figures since the last read (`StepFigures`), as
        numbers: read only when the trainer logs (each read of a device tensor waits for the device)."""
        if self.memory is None:
            return {}
        return {**{k: float(v) for k, v in self.memory.last_diagnostics.items()}, **self.figures.take()}

    def check_finite(self) -> None:
        """Raise `NonFiniteLossError` naming the iteration if a memory update had a non-finite target."""
        if self.memory is not None:
            self.memory.check_finite()


def memory_start_iteration(params: Params, steps_per_epoch: int) -> int:
    """The first iteration that uses the memory: `memory.start` epochs (or the head warm-up) of steps, then
    `memory.delay_steps` more."""
    start = params.memory.start
    epochs = params.train.warmup_epochs if start == "after_warmup" else start
    return epochs * steps_per_epoch + params.memory.delay_steps


def build_mpn_loss(params: Params, train_labels) -> IntraBatchLoss | None:
    """The Intra-Batch loss of `model.mpn` (nulls: the paper's setting for the dataset), or None."""
    cfg = params.model.mpn.resolved(params.data.dataset)
    if not cfg.enabled:
        return None
    if train_labels is None:
        raise ValueError("model.mpn.enabled needs the training labels to size its classifiers")
    assert cfg.layers is not None and cfg.heads is not None and cfg.temperature is not None  # resolved
    mpn = MessagePassingNetwork(params.model.embedding_dim, cfg.layers, cfg.heads, cfg.ffn_multiplier,
                                cfg.dropout)
    return IntraBatchLoss(mpn, train_labels, cfg.temperature, cfg.label_smoothing, cfg.aux_weight)


def build_criterion(params: Params, num_train_images: int, train_labels=None,
                    steps_per_epoch: int | None = None) -> Criterion:
    """`train_labels` (the training split's, 0..C-1) size classification/proxy losses; `steps_per_epoch`
    (default num_train_images // batch_size) turns loss.memvir.warmup_epochs into steps."""
    num_classes = len(np.unique(np.asarray(train_labels))) if train_labels is not None else None
    loss = build_loss(params.loss.name, params.loss.params, num_classes=num_classes,
                      embedding_size=params.model.embedding_dim)
    if any(isinstance(getattr(loss, slot, None), nn.Parameter) for slot in ("W", "proxies")):
        if params.memory.method != "none":  # PML's CrossBatchMemory passes ref_emb, which these refuse
            raise ConfigError(f"loss.name={params.loss.name} keeps class weights and cannot be taken against "
                              f"a cross-batch memory: set memory.method=none (got {params.memory.method})")
        if num_classes is not None and int(np.max(train_labels)) >= num_classes:
            raise ValueError(f"loss.name={params.loss.name} indexes its class weights by label: the training "
                             f"labels must be 0..{num_classes - 1}, got up to {int(np.max(train_labels))}")
    steps = steps_per_epoch or max(1, num_train_images // params.train.batch_size)
    if params.loss.memvir.enabled:
        mv = params.loss.memvir
        loss = MemVir(loss, num_classes or 0, mv.num_steps, mv.step_gap, round(mv.warmup_epochs * steps))
    miner = build_miner(params.loss.miner, params.loss.miner_params)
    if params.loss.rho.p_switch > 0:  # Roth et al. 2020 Sec. 5; around all triplets when there is no miner
        miner = RhoRegularizedMiner(miner, params.loss.rho.p_switch, seed=params.train.seed,
                                    pairs=isinstance(loss, GenericPairLoss))
    memory = None
    if params.memory.method != "none":
        rows = memory_rows(params.memory.size, num_train_images, params.train.batch_size)
        check_memory_fits(params.memory.size, rows, params.model.embedding_dim, num_train_images)
        memory_miner = miner if params.memory.mine else None  # memory.mine=false: all pairs against the memory
        m = params.memory  # the oracle's memory is XBM's: the trainer re-embeds its rows (training.trainer)
        memory = cross_batch_memory(
            loss, params.model.embedding_dim, rows, "xbm" if m.method == "oracle" else m.method, memory_miner,
            kalman=m.kalman.model_dump(), ema_momentum=m.ema_momentum, innovation_momentum=m.innovation_momentum,
            exclude_self=m.exclude_self, attach_batch=m.attach_batch, center_gradient=m.centred,
            no_positive=params.loss.no_positive)
    return Criterion(loss, miner, memory, memory_start_iteration(params, steps), params.memory.add_batch_loss,
                     mpn_loss=build_mpn_loss(params, train_labels), no_positive=params.loss.no_positive)
