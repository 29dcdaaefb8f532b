"""A cross-batch memory whose stored embeddings are kept up to date by moment matching (XBN / AXBN).

Built on pytorch-metric-learning's `CrossBatchMemory` (its ring buffer, miner handling and self-comparison
removal). What it adds, written by hand because no library has it:

- Before the current batch is enqueued, every valid stored row z becomes (z - E[R]) / sigma[R] * sigma* + mu*
  (seed 000, Eq. 6), where (mu*, sigma*) come from a moment estimator (`moments.py`): the batch's moments (XBN),
  a Kalman estimate (AXBN) or an EMA.
- The memory's per-dimension sums and sums of squares are kept up to date in O(B d) per step (on enqueue, on
  dequeue and analytically through each affine map) instead of re-reducing M x d values, and the map itself is
  one fused pass over the rows. The sums are recomputed exactly every `refresh_interval` steps so float error
  cannot accumulate.
- At small M that pass is cheap and the step's cost is the number of small d-vector operations (each one a few
  microseconds of dispatch on a CPU): one reduction gives the batch's and the dequeued rows' sums and squares,
  the batch and memory moments come out of one stacked [2, 2, d] tensor, the checks and the report of a
  non-finite update use one stacked tensor, and the diagnostics are reduced only when the trainer reads them.
- The queue pointer and fill flag live in `state_dict` (PML keeps them as plain attributes, so a resumed run
  would silently differ).
- Each row keeps its dataset index (`source_memory`), so `exclude_self` can keep an anchor from meeting an
  earlier view of its own image, and `attach_batch` keeps the batch's own rows attached in the loss (issue 42).
- A set of slots can keep their inputs (`StoredInputs`: the augmented view, uint8, and the row as written), so
  the trainer can re-embed them with the current model: every slot for the drift-free oracle, a fixed sample for
  the drift measurement (seed 000 Sec. 5, Fig. 2).
- The loss's and the miner's distances normalise the reference set (every stored row) on each call:
  pytorch-metric-learning's `F.normalize` writes a fresh M x d copy each time, twice per step with a miner.
  Here the valid rows are normalised once per step into a kept buffer, a cache-sized block of rows at a time,
  and every distance that normalises with the L2 norm is handed that buffer (`_SharedUnitRows`). A
  fresh copy is M x d new pages on every call; the kept buffer is written in place (the memory step's cost:
  docs/benchmarks.md). The map stays a pass of its own: fusing it with the normalisation gained nothing inside
  a training step.
- No step waits for the device: counters are Python ints, the diagnostics stay 0-d device tensors until the
  trainer logs them (every `train.log_every` steps), and the finiteness of the map is decided on the device.
  A non-finite update (a NaN gain, an inf in the batch or the memory's moments: any non-finite value among
  the batch's and memory's moments, the target moments, the gain and the map) leaves every row as it was
  (the map becomes the identity) and is recorded with its iteration; `check_finite`, which the trainer calls
  when it logs and before it saves a checkpoint, then raises `NonFiniteLossError` naming that iteration.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning.distances import BaseDistance
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
from torch import nn

from xbn.memory.moments import MomentEstimator
from xbn.memory.positives import MINING_COUNTS, needs_positive, with_positive
from xbn.utils.errors import NonFiniteLossError

# Dimensions whose memory std is at most this are shifted, not scaled: with sigma[R] = 0 every row equals
# E[R], so Eq. 6 sends it to mu*, and a shift does that without dividing by zero.
STD_EPS = 1e-6
# Rows per block when the sums are recomputed from the stored rows (256 x 512 float64: 1 MB, cache-sized).
REFRESH_BLOCK = 256
# Rows per block when the memory's rows are normalised into the shared buffer (2048 x 512 float32: 4 MB).
UNIT_BLOCK = 2048
# The rows of the per-step stack `_adapt` checks and, for the first non-finite update, keeps (its report).
CHECKED = ("batch_mean", "memory_mean", "batch_std", "memory_std", "scale", "shift", "target_mean", "target_std",
           "gain")


class StoredInputs:
    """The inputs of a fixed set of memory slots (issue 42), written by hand: the augmented view each row was
    embedded from, as uint8 at the training size (de-normalised with the backbone's mean and std), the row as
    it was written (before any map) and the training iteration that wrote it. Enough to re-embed those rows
    with the current model (`CrossBatchMemory.reembed`, `xbn.training.diagnostics.memory_drift`)."""

    def __init__(self, slots: torch.Tensor, memory_size: int, mean, std):
        self.slots = torch.as_tensor(slots, dtype=torch.long).unique()  # sorted
        self.position = torch.full((memory_size,), -1, dtype=torch.long)  # slot -> row here, -1 untracked
        self.position[self.slots] = torch.arange(len(self.slots))
        self.mean = torch.as_tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.inputs: torch.Tensor | None = None  # [S, C, H, W] uint8, allocated at the first write
        self.raw: torch.Tensor | None = None  # [S, d]
        self.written_at = torch.full((len(self.slots),), -1, dtype=torch.long)  # host: read to pick valid rows

    def __len__(self) -> int:
        return len(self.slots)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        mean, std = self.mean.to(images.device), self.std.to(images.device)
        return (images.float() * std + mean).mul_(255).round_().clamp_(0, 255).to(torch.uint8)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """The stored views of `rows` (positions here) as the model's normalised float input."""
        assert self.inputs is not None, "no tracked slot has been written yet"
        u8 = self.inputs[rows.to(self.inputs.device)]
        mean, std = self.mean.to(u8.device), self.std.to(u8.device)
        return (u8.float().div_(255) - mean) / std

    def write(self, batch_slots: torch.Tensor, images: torch.Tensor, rows: torch.Tensor, iteration: int) -> None:
        """Keep the views and rows of the batch's tracked slots (`batch_slots`: a host tensor)."""
        where = self.position[batch_slots]  # host tensors: no wait for the device
        keep = (where >= 0).nonzero().flatten()
        if not len(keep):
            return
        if self.inputs is None or self.raw is None:
            self.inputs = torch.zeros((len(self), *images.shape[1:]), dtype=torch.uint8, device=images.device)
            self.raw = torch.zeros((len(self), rows.shape[1]), dtype=rows.dtype, device=rows.device)
        inputs, raw = self.inputs, self.raw
        at, keep_dev = where[keep].to(inputs.device), keep.to(images.device)
        inputs[at] = self.encode(images[keep_dev])
        raw[at] = rows[keep_dev].to(raw.dtype)
        self.written_at[where[keep]] = iteration

    def valid(self, num_valid: int) -> torch.Tensor:
        """Positions here whose slot holds a row written with its input."""
        return ((self.written_at >= 0) & (self.slots < num_valid)).nonzero().flatten()

    def state(self) -> dict:
        return {"slots": self.slots, "inputs": self.inputs, "raw": self.raw, "written_at": self.written_at}

    def load(self, state: dict) -> None:
        if not torch.equal(state["slots"].cpu(), self.slots):
            raise ValueError("the checkpoint's memory tracked other slots (memory.size or train.drift_rows "
                             "changed)")
        self.inputs, self.raw, self.written_at = state["inputs"], state["raw"], state["written_at"].cpu()


class _SharedUnitRows:
    """Stands in for a pytorch-metric-learning distance's `normalize` (an instance attribute, so the distance's
    class and every other use of it are untouched): the memory's valid rows, as the memory passes them to the
    miner and the loss during its forward, come back as the memory's shared normalised copy; any other tensor
    (the batch, a distance used outside the memory) goes to the distance's own `normalize`."""

    def __init__(self, memory: CrossBatchMemory, normalize):
        self.memory, self.normalize = memory, normalize

    def __call__(self, embeddings: torch.Tensor, dim: int = 1, **kwargs) -> torch.Tensor:
        shared = self.memory.unit_rows_for(embeddings) if dim == 1 and not kwargs else None
        return self.normalize(embeddings, dim=dim, **kwargs) if shared is None else shared


def _share_unit_rows(memory: CrossBatchMemory, *modules: nn.Module | None) -> int:
    """Give every L2-normalising distance inside `modules` the memory's shared normalised rows; returns how
    many distances now share them."""
    shared = 0
    for module in modules:
        for sub in module.modules() if module is not None else ():
            if (isinstance(sub, BaseDistance) and getattr(sub, "p", None) == 2
                    and not isinstance(sub.normalize, _SharedUnitRows)):
                sub.normalize = _SharedUnitRows(memory, sub.normalize)
                shared += 1
    return shared


class CrossBatchMemory(pml_losses.CrossBatchMemory):
    """XBM with `moments=None` (rows kept as written); XBN, AXBN, EMA or auto-tuned AXBN with the matching
    estimator from `moments.py` (`BatchMoments`, `KalmanMoments`, `EMAMoments`, `AdaptiveKalmanMoments`).

    `exclude_self`: an anchor never meets a stored row of its own image (needs the batch's dataset indices,
    `set_batch(sources=...)`). `attach_batch`: the batch's own rows keep their gradient in the loss."""

    # Buffers (PML's and ours), declared for the type checker: nn.Module types attributes as Tensor | Module.
    embedding_memory: torch.Tensor
    label_memory: torch.Tensor
    row_sum: torch.Tensor
    row_sq_sum: torch.Tensor
    source_memory: torch.Tensor

    def __init__(
        self,
        loss: nn.Module,
        embedding_size: int,
        memory_size: int,
        miner: nn.Module | None = None,
        moments: MomentEstimator | None = None,
        refresh_interval: int = 100,
        exclude_self: bool = False,
        attach_batch: bool = False,
        no_positive: str = "all_pairs",
        center_gradient: bool = False,
    ):
        super().__init__(loss, embedding_size, memory_size=memory_size, miner=miner)
        # loss.no_positive, as in the minibatch loss (`with_positive`); the counts since `take_mining`, and the
        # last forward's mined positive and negative pairs (host ints: their shapes, no device read).
        self.repair_no_positive = no_positive == "all_pairs" and needs_positive(loss)
        self.mining = dict.fromkeys(MINING_COUNTS, 0)
        self.last_pairs: tuple[int, int] | None = None
        self.center_gradient = center_gradient
        self.moments = moments
        self.refresh_interval = refresh_interval
        self.exclude_self, self.attach_batch = exclude_self, attach_batch
        self.register_buffer("row_sum", torch.zeros(embedding_size, dtype=torch.float64))
        self.register_buffer("row_sq_sum", torch.zeros(embedding_size, dtype=torch.float64))
        # Each row's dataset index (-1: not known), and the batch's, set before each step by `set_batch`.
        self.register_buffer("source_memory", torch.full((memory_size,), -1, dtype=torch.long))
        self._batch_sources: torch.Tensor | None = None
        self._batch_inputs: torch.Tensor | None = None
        self.stored: StoredInputs | None = None  # `track_inputs`
        # The per-dimension batch mean's sum and sum of squares over the steps since `take_batch_noise`.
        self._batch_mean_sums: torch.Tensor | None = None
        self._batch_mean_steps = 0
        self.adaptation_steps = 0  # memory updates seen with stored rows (drives the sums' refresh)
        self.iteration: int | None = None  # the training iteration, set by `Criterion`: named in errors
        # What the last update saw, reduced to `last_diagnostics` only when read (see there).
        self._seen: tuple | None = None
        # The first non-finite update, kept on the device (see `check_finite`); not state: a run stops at it.
        # `_failed_at`: 0 none, > 0 that training iteration, < 0 minus that memory update (no `iteration`);
        # `_failed`: the stack `_adapt` checked in that update (rows: CHECKED).
        self._clean = torch.ones((), dtype=torch.bool)
        self._failed_at = torch.zeros((), dtype=torch.float64)
        self._failed: torch.Tensor | None = None
        self._identity: torch.Tensor | None = None  # the map (scale 1, shift 0) a non-finite update becomes
        # The valid rows L2-normalised (`unit_rows_for`): a kept buffer, filled at most once per forward; its
        # first `_unit_current` rows are current (0: stale).
        self._unit_buffer: torch.Tensor | None = None
        self._unit_current = 0
        self._in_forward = False
        self.shared_distances = _share_unit_rows(self, self.loss, self.miner)

    # -- state that PML keeps outside state_dict -------------------------------------------------------------
    def get_extra_state(self):
        return {
            "queue_idx": int(self.queue_idx),
            "has_been_filled": bool(self.has_been_filled),
            "adaptation_steps": self.adaptation_steps,
            "batch_mean_sums": self._batch_mean_sums, "batch_mean_steps": self._batch_mean_steps,
            **({"stored": self.stored.state()} if self.stored is not None else {}),
        }

    def set_extra_state(self, state):
        self.queue_idx = int(state["queue_idx"])
        self.has_been_filled = bool(state["has_been_filled"])
        self.adaptation_steps = int(state["adaptation_steps"])
        self._batch_mean_sums = state.get("batch_mean_sums")
        self._batch_mean_steps = int(state.get("batch_mean_steps", 0))
        if self.stored is not None and "stored" in state:
            self.stored.load(state["stored"])

    # -- what the memory knows of each row's input (issue 42) ---------------------------------------------
    def set_batch(self, sources: torch.Tensor | None = None, inputs: torch.Tensor | None = None) -> None:
        """The next batch's dataset indices and (normalised) input images, for `exclude_self` and the tracked
        slots; used by the next forward only."""
        self._batch_sources, self._batch_inputs = sources, inputs

    def track_inputs(self, slots, mean, std) -> StoredInputs:
        """Keep the inputs of `slots` from now on (`StoredInputs`; mean/std: the input normalisation)."""
        self.stored = StoredInputs(slots, self.memory_size, mean, std)
        return self.stored

    @torch.no_grad()
    def reembed(self, embed, iteration: int, chunk: int = 256) -> int:
        """The oracle (issue 42): every tracked valid row becomes `embed(its stored input)`, the current model's
        embedding of the same view, written as a fresh row at `iteration`; returns how many were re-embedded."""
        stored = self.stored
        assert stored is not None, "the oracle re-embeds tracked slots: call track_inputs first"
        rows = stored.valid(self.num_valid)
        if not len(rows) or stored.raw is None:
            return 0
        self._unit_current = 0
        for part in rows.split(chunk):
            fresh = embed(stored.decode(part)).to(self.embedding_memory.dtype)
            slots = stored.slots[part].to(self.embedding_memory.device)
            self.embedding_memory[slots] = fresh
            stored.raw[part.to(stored.raw.device)] = fresh.to(stored.raw.dtype)
            stored.written_at[part] = iteration
        self.refresh_sums()
        return len(rows)

    def take_batch_noise(self) -> float | None:
        """The spread of the per-dimension batch mean across the steps since the last call: the mean over
        dimensions of its std (what Eq. 6's target moments carry as noise at a small batch); None before 2."""
        sums, n = self._batch_mean_sums, self._batch_mean_steps
        self._batch_mean_sums, self._batch_mean_steps = None, 0
        if sums is None or n < 2:
            return None
        mean = sums[0] / n
        return float(((sums[1] / n - mean * mean).clamp_min(0) * n / (n - 1)).sqrt().mean())

    def last_scale(self) -> torch.Tensor | None:
        """The last map's per-dimension scale (Eq. 6's sigma*/sigma[R]), None without an estimator."""
        if self.moments is None or self._seen is None:
            return None
        return self._seen[1][0]

    # -- the loss -------------------------------------------------------------------------------------------
    def forward(self, embeddings, labels, indices_tuple=None, enqueue_mask=None):
        self._in_forward, self._unit_current = True, 0
        if self.center_gradient and embeddings.requires_grad:
            embeddings = _CenteredGradient.apply(embeddings)
        try:
            if not self.attach_batch or enqueue_mask is not None:
                return super().forward(embeddings, labels, indices_tuple, enqueue_mask)
            return self._attached_forward(embeddings, labels, indices_tuple)
        finally:
            self._batch_sources = self._batch_inputs = None
            self._in_forward, self._unit_current = False, 0

    def unit_rows_for(self, reference: torch.Tensor) -> torch.Tensor | None:
        """The stored rows L2-normalised as `F.normalize` would give them, if `reference` is the memory's valid
        rows as this forward passes them to the miner and the loss (the same storage, rows and layout);
        None otherwise. Filled once per forward into a kept buffer: PML's distances would each allocate and
        fill their own copy."""
        memory = self.embedding_memory
        n = len(reference)
        if (not self._in_forward or reference.requires_grad or reference.data_ptr() != memory.data_ptr()
                or reference.dtype != memory.dtype or reference.device != memory.device
                or reference.stride() != memory.stride() or n != self.num_valid):
            return None
        buffer = self._unit_buffer
        if buffer is None or buffer.dtype != memory.dtype or buffer.device != memory.device:
            buffer = self._unit_buffer = torch.empty_like(memory)
        if self._unit_current != n:
            _normalise_rows(reference, buffer[:n])
            self._unit_current = n
        return buffer[:n]

    def _attached_forward(self, embeddings, labels, indices_tuple):
        """PML's forward (no enqueue mask), but the loss's reference set holds the batch's live embeddings in the
        slots just written, so a pair inside the batch gets gradient through both of its sides."""
        self.reset_stats()
        labels = labels.to(embeddings.device)
        self.embedding_memory = self.embedding_memory.to(embeddings.device, embeddings.dtype)
        self.label_memory = self.label_memory.to(embeddings.device, labels.dtype)
        self.add_to_memory(embeddings, labels, len(embeddings))
        n = self.num_valid
        E_mem = self.embedding_memory[:n].index_put((self.curr_batch_idx,), embeddings)
        L_mem = self.label_memory[:n]
        indices_tuple = self.create_indices_tuple(embeddings, labels, E_mem, L_mem, indices_tuple, True)
        return self.loss(embeddings, labels, indices_tuple, E_mem, L_mem)

    @classmethod
    def supported_losses(cls):
        return [*super().supported_losses(), "XBMContrastiveLoss"]

    def create_indices_tuple(self, embeddings, labels, E_mem, L_mem, input_indices_tuple,
                             do_remove_self_comparisons):
        indices = self._own_rows_out(super().create_indices_tuple(
            embeddings, labels, E_mem, L_mem, input_indices_tuple, do_remove_self_comparisons), labels, E_mem)
        if len(indices) == 4:
            self.last_pairs = (len(indices[0]), len(indices[2]))

        def all_pairs():  # PML's pairs without a miner, less the same rows as above
            pairs = lmu.get_all_pairs_indices(labels, L_mem)
            if do_remove_self_comparisons:
                pairs = lmu.remove_self_comparisons(pairs, self.curr_batch_idx, self.memory_size)
            return self._own_rows_out(pairs, labels, E_mem)

        return with_positive(indices, all_pairs, self.repair_no_positive, self.mining)

    def _own_rows_out(self, indices: tuple, labels: torch.Tensor, E_mem: torch.Tensor) -> tuple:
        if not self.exclude_self or self._batch_sources is None or len(self._batch_sources) != len(labels):
            return indices
        return _without_own_image(indices, self._batch_sources.to(labels.device),
                                  self.source_memory[: len(E_mem)])

    def take_mining(self) -> dict[str, int]:
        counts, self.mining = self.mining, dict.fromkeys(MINING_COUNTS, 0)
        return counts

    @property
    def num_valid(self) -> int:
        return self.memory_size if self.has_been_filled else int(self.queue_idx)

    def valid_rows(self) -> torch.Tensor:
        return self.embedding_memory[: self.num_valid]

    def memory_moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-dimension mean and (population) std of the valid rows, from the running sums."""
        return _moments(self.row_sum, self.row_sq_sum, max(self.num_valid, 1))

    def refresh_sums(self) -> None:
        """Re-reduce the sums from the stored rows, in float64, a block of rows at a time: a float64 copy of the
        whole memory would leave the cache."""
        self.row_sum.zero_()
        self.row_sq_sum.zero_()
        for block in self.valid_rows().split(REFRESH_BLOCK):
            rows = block.double()
            self.row_sum.add_(rows.sum(0))
            self.row_sq_sum.add_((rows * rows).sum(0))

    @property
    def last_diagnostics(self) -> dict[str, torch.Tensor | float]:
        """The last update's mean statistics as 0-d device tensors (the caller reads them when it logs): the
        memory's moments as the update saw them (before the batch was enqueued), and with an estimator the
        batch's, the map's mean scale and the estimator's gain. Reduced here, not in every step."""
        if self._seen is None:
            return {}
        if self.moments is None:
            sums, n = self._seen
            mean, std = _moments(sums[0], sums[1], n)
            return {"memory_mean": mean.mean(), "memory_std": std.mean()}
        checked, affine = self._seen
        return {**self.moments.diagnostics(), "memory_mean": checked[1].mean(), "memory_std": checked[3].mean(),
                "batch_mean": checked[0].mean(), "batch_std": checked[2].mean(), "scale": affine[0].mean()}

    # -- the memory update ----------------------------------------------------------------------------------
    def add_to_memory(self, embeddings, labels, batch_size):
        self._unit_current = 0  # the rows change: the shared normalised copy is stale
        embeddings = embeddings.detach()
        self._move_state(embeddings.device)
        n = self.num_valid
        if n > 0 and self.adaptation_steps % self.refresh_interval == 0:
            self.refresh_sums()
        batch_sums, dequeued_sums, dequeued = self._new_and_dequeued_sums(embeddings, batch_size)
        if n > 0:
            if self.moments is not None:
                self._adapt(self.moments, batch_sums, dequeued_sums, n, dequeued, len(embeddings))
            else:  # xbm: rows stay as written; the moments are still worth watching
                self._seen = (torch.stack([self.row_sum, self.row_sq_sum]), n)
                if dequeued:
                    self._add_sums(dequeued_sums, -1)
            self.adaptation_steps += 1
        self._add_sums(batch_sums, 1)
        if self.stored is not None:  # read only by the drift measurement, which needs the stored inputs
            self._count_batch_mean(batch_sums[0] / len(embeddings))
        start = int(self.queue_idx)
        super().add_to_memory(embeddings, labels, batch_size)
        self._write_sources(embeddings, start)

    def _count_batch_mean(self, batch_mean: torch.Tensor) -> None:
        if self._batch_mean_sums is None or self._batch_mean_sums.device != batch_mean.device:
            self._batch_mean_sums = torch.zeros((2, len(batch_mean)), dtype=torch.float64,
                                                device=batch_mean.device)
            self._batch_mean_steps = 0
        self._batch_mean_sums[0].add_(batch_mean)
        self._batch_mean_sums[1].addcmul_(batch_mean, batch_mean)
        self._batch_mean_steps += 1

    def _write_sources(self, embeddings: torch.Tensor, start: int) -> None:
        slots = self.curr_batch_idx
        sources, inputs = self._batch_sources, self._batch_inputs
        if self.exclude_self:  # the only reader of the rows' dataset indices
            if self.source_memory.device != slots.device:
                self.source_memory = self.source_memory.to(slots.device)
            self.source_memory[slots] = (sources.to(slots.device)  # unknown (-1) unless aligned with the batch
                                         if sources is not None and len(sources) == len(slots) else -1)
        if self.stored is not None and inputs is not None and len(inputs) == len(slots):
            # The slots again, on the host (reading curr_batch_idx back would make the step wait for the GPU).
            host_slots = torch.arange(start, start + len(slots)) % self.memory_size
            self.stored.write(host_slots, inputs, embeddings, self.iteration or 0)

    def _move_state(self, device: torch.device) -> None:
        # PML moves the memory to the batch's device in forward(); the sums must follow it.
        if self.row_sum.device != device:
            self.row_sum = self.row_sum.to(device)
            self.row_sq_sum = self.row_sq_sum.to(device)
        if self._clean.device != device:
            self._clean, self._failed_at = self._clean.to(device), self._failed_at.to(device)
            self._failed = None if self._failed is None else self._failed.to(device)
            self._identity = None

    def _add_sums(self, sums: torch.Tensor, sign: int) -> None:
        self.row_sum.add_(sums[0], alpha=sign)
        self.row_sq_sum.add_(sums[1], alpha=sign)

    def _new_and_dequeued_sums(self, batch: torch.Tensor, batch_size: int):
        """Per-dimension sums and sums of squares (float64, [2, d] each) of the batch and of the valid rows it
        is about to overwrite, read before any map changes them, in one reduction; and how many rows those are.
        The dequeued rows are counted in Python and sliced (a boolean mask or index would wait or gather)."""
        start, size = int(self.queue_idx), self.memory_size
        if self.has_been_filled:
            end = start + batch_size
            spans = [(start, min(end, size))] + ([(0, end - size)] if end > size else [])
        else:  # only the rows that wrap around onto stored ones: positions 0 .. start + B - M - 1
            wrapped = start + batch_size - size
            spans = [(0, wrapped)] if wrapped > 0 else []
        b = len(batch)
        dequeued = sum(stop - begin for begin, stop in spans)
        values = torch.empty((2, b + dequeued, self.embedding_size), dtype=torch.float64, device=batch.device)
        rows, squares = values
        rows[:b] = batch
        at = b
        for begin, stop in spans:
            rows[at:at + stop - begin] = self.embedding_memory[begin:stop]
            at += stop - begin
        torch.mul(rows, rows, out=squares)
        return values[:, :b].sum(1), (values[:, b:].sum(1) if dequeued else None), dequeued

    def _adapt(self, estimator: MomentEstimator, batch_sums: torch.Tensor, dequeued_sums: torch.Tensor | None,
               n: int, dequeued: int, batch_size: int) -> None:
        # [batch, memory] x [sum, sum of squares] -> [batch, memory] x [mean, second moment] -> moments
        moments = torch.stack([batch_sums, torch.stack([self.row_sum, self.row_sq_sum])])
        moments[0].div_(batch_size)
        moments[1].div_(n)
        means, second_moments = moments.unbind(1)  # (views; no autograd: the batch is detached, rows are buffers)
        stds = torch.addcmul(second_moments, means, means, value=-1).clamp_min_(0.0).sqrt_()
        (batch_mean, memory_mean), (batch_std, memory_std) = means, stds
        target_mean, target_std = estimator(memory_mean, memory_std, batch_mean, batch_std, batch_size)

        # Eq. 6 as one affine map per dimension: z -> scale * z + shift.
        scale = torch.div(target_std, memory_std).masked_fill_(memory_std <= STD_EPS, 1.0)
        shift = torch.addcmul(target_mean, scale, memory_mean, value=-1)
        gain = getattr(estimator, "gain", None)
        checked = torch.stack([batch_mean, memory_mean, batch_std, memory_std, scale, shift, target_mean,
                               target_std, *([gain] if gain is not None else [])])
        affine = self._finite_or_identity(checked, checked[4:6])
        rows = self.valid_rows()
        scale32, shift32 = affine.to(rows.dtype)
        torch.addcmul(shift32, rows, scale32, out=rows)

        # The sums follow the map analytically over the rows that stay, m of them:
        # sum' = a sum + m b, sq' = a^2 sq + 2ab sum + m b^2 = a (a sq + 2b sum) + m b^2.
        if dequeued_sums is not None:
            self._add_sums(dequeued_sums, -1)
        (a, b), m = affine, n - dequeued
        self.row_sq_sum.mul_(a).addcmul_(b, self.row_sum, value=2).mul_(a).addcmul_(b, b, value=m)
        self.row_sum.mul_(a).add_(b, alpha=m)
        self._seen = (checked, affine)

    def _finite_or_identity(self, checked: torch.Tensor, affine: torch.Tensor) -> torch.Tensor:
        """`affine` if every value in `checked` is finite, else the identity map; the first such update is
        kept (where, and the stack itself), all decided on the device (no host wait)."""
        if self._identity is None or self._identity.shape != affine.shape:
            self._identity = torch.stack([torch.ones_like(affine[0]), torch.zeros_like(affine[0])])
        if self._failed is None or self._failed.shape != checked.shape:
            self._failed = torch.zeros_like(checked)
        # One NaN or inf anywhere makes the sum NaN or inf (inf - inf = NaN). At 9 x 512 on an AVX2 CPU a sum
        # took 3 us, isfinite().all() 36 and a dot with zeros 26.
        finite = checked.sum().isfinite()
        first = self._clean > finite
        self._clean.logical_and_(finite)  # in place, as below: no nn.Module.__setattr__ per step
        at = self.iteration if self.iteration is not None else -(self.adaptation_steps + 1)
        self._failed_at.add_(first, alpha=at)  # 0 until the first failure, then its place: `first` is true once
        torch.where(first, checked, self._failed, out=self._failed)
        return torch.where(finite, affine, self._identity)

    def check_finite(self) -> None:
        """Raise `NonFiniteLossError` if an update since the start had a non-finite target (one host read)."""
        if self._failed is None:
            return
        bad = (~torch.isfinite(self._failed)).sum(1).double()
        at, *counts = torch.cat([self._failed_at.view(1), bad]).tolist()
        if at == 0:
            return
        report = dict(zip(CHECKED, counts))
        where = f"{'iteration' if at > 0 else 'memory update'} {int(abs(at))}"
        what = type(self.moments).__name__.removesuffix("Moments")
        d = self.embedding_size
        gain = (f"; {what} gain non-finite in {int(report['gain'])} dims" if "gain" in report else "")
        raise NonFiniteLossError(
            f"at {where}: the memory's target moments are not finite (mean: {int(report['target_mean'])} of "
            f"{d} dims non-finite, std: {int(report['target_std'])} of {d}{gain}; batch finite: "
            f"{report['batch_mean'] == 0}, memory moments finite: "
            f"{report['memory_mean'] + report['memory_std'] == 0}); the memory's rows were left as they were "
            f"from this update on")


class _CenteredGradient(torch.autograd.Function):
    """The identity, whose backward subtracts the gradient's mean over the batch (issue 52), written by hand.
    Stored rows take no gradient, so the part of the memory loss's gradient common to every anchor moves the
    whole batch away from them together; the stored rows follow a step later, and the batch contracts onto one
    point as it runs. Without that common part each anchor still moves toward its positives and away from its
    negatives, relative to the others."""

    @staticmethod
    def forward(ctx, embeddings):
        return embeddings.view_as(embeddings)

    @staticmethod
    def backward(ctx, grad):
        return grad - grad.mean(0, keepdim=True)


def _without_own_image(indices: tuple, batch_sources: torch.Tensor, memory_sources: torch.Tensor) -> tuple:
    """Mined pairs (a1, p, a2, n) or triplets (a, p, n) without any whose memory row is of the anchor's own
    image (same dataset index); unknown sources (-1) are kept."""
    def other(anchors, refs):
        own = memory_sources[refs]
        return (own < 0) | (own != batch_sources[anchors])
    if len(indices) == 4:
        a1, p, a2, n = indices
        keep_p, keep_n = other(a1, p), other(a2, n)
        return a1[keep_p], p[keep_p], a2[keep_n], n[keep_n]
    a, p, n = indices
    keep = other(a, p) & other(a, n)
    return a[keep], p[keep], n[keep]


def _normalise_rows(rows: torch.Tensor, out: torch.Tensor) -> None:
    """`F.normalize(rows)` (PML's call) into `out`, a cache-sized block of rows at a time on a CPU (one read of
    each row from memory); in one piece on a GPU, where every launch costs."""
    block = len(rows) if rows.is_cuda else UNIT_BLOCK
    for part, part_out in zip(rows.split(block), out.split(block)):
        F.normalize(part, p=2, dim=1, out=part_out)


def _moments(row_sum: torch.Tensor, row_sq_sum: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    mean = row_sum / n
    var = (row_sq_sum / n - mean * mean).clamp_min_(0.0)
    return mean, var.sqrt()
