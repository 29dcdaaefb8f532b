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
- No step waits for the device: counters are Python ints, the diagnostics stay 0-d device tensors until the
  trainer logs them (every `train.log_every` steps), and the finiteness of the map is decided on the device.
  A non-finite update (a NaN gain, an inf in the batch or the memory's moments: any non-finite value among
  the batch's and memory's moments, the target moments, the gain and the map) leaves every row as it was
  (the map becomes the identity) and is recorded with its iteration; `check_finite`, which the trainer calls
  when it logs and before it saves a checkpoint, then raises `NonFiniteLossError` naming that iteration.
"""

from __future__ import annotations

import torch
from pytorch_metric_learning import losses as pml_losses
from torch import nn

from xbn.utils.errors import NonFiniteLossError

# Dimensions whose memory std is at most this are shifted, not scaled: with sigma[R] = 0 every row equals
# E[R], so Eq. 6 sends it to mu*, and a shift does that without dividing by zero.
STD_EPS = 1e-6
# Rows per block when the sums are recomputed from the stored rows (256 x 512 float64: 1 MB, cache-sized).
REFRESH_BLOCK = 256
# The rows of the per-step stack `_adapt` checks and, for the first non-finite update, keeps (its report).
CHECKED = ("batch_mean", "memory_mean", "batch_std", "memory_std", "scale", "shift", "target_mean", "target_std",
           "gain")


class CrossBatchMemory(pml_losses.CrossBatchMemory):
    """XBM with `moments=None` (rows kept as written); XBN, AXBN, EMA or auto-tuned AXBN with the matching
    estimator from `moments.py` (`BatchMoments`, `KalmanMoments`, `EMAMoments`, `AdaptiveKalmanMoments`)."""

    def __init__(
        self,
        loss: nn.Module,
        embedding_size: int,
        memory_size: int,
        miner: nn.Module | None = None,
        moments: nn.Module | None = None,
        refresh_interval: int = 100,
    ):
        super().__init__(loss, embedding_size, memory_size=memory_size, miner=miner)
        self.moments = moments
        self.refresh_interval = refresh_interval
        self.register_buffer("row_sum", torch.zeros(embedding_size, dtype=torch.float64))
        self.register_buffer("row_sq_sum", torch.zeros(embedding_size, dtype=torch.float64))
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

    # -- state that PML keeps outside state_dict -------------------------------------------------------------
    def get_extra_state(self):
        return {
            "queue_idx": int(self.queue_idx),
            "has_been_filled": bool(self.has_been_filled),
            "adaptation_steps": self.adaptation_steps,
        }

    def set_extra_state(self, state):
        self.queue_idx = int(state["queue_idx"])
        self.has_been_filled = bool(state["has_been_filled"])
        self.adaptation_steps = int(state["adaptation_steps"])

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
        whole memory would leave the cache (4096 x 512 rows: 4.9 ms in one piece, 1.9 ms in blocks of 256)."""
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
        embeddings = embeddings.detach()
        self._move_state(embeddings.device)
        n = self.num_valid
        if n > 0 and self.adaptation_steps % self.refresh_interval == 0:
            self.refresh_sums()
        batch_sums, dequeued_sums, dequeued = self._new_and_dequeued_sums(embeddings, batch_size)
        if n > 0:
            if self.moments is not None:
                self._adapt(batch_sums, dequeued_sums, n, dequeued, len(embeddings))
            else:  # xbm: rows stay as written; the moments are still worth watching
                self._seen = (torch.stack([self.row_sum, self.row_sq_sum]), n)
                if dequeued:
                    self._add_sums(dequeued_sums, -1)
            self.adaptation_steps += 1
        self._add_sums(batch_sums, 1)
        super().add_to_memory(embeddings, labels, batch_size)

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

    def _adapt(self, batch_sums: torch.Tensor, dequeued_sums: torch.Tensor | None, n: int, dequeued: int,
               batch_size: int) -> None:
        # [batch, memory] x [sum, sum of squares] -> [batch, memory] x [mean, second moment] -> moments
        moments = torch.stack([batch_sums, torch.stack([self.row_sum, self.row_sq_sum])])
        moments[0].div_(batch_size)
        moments[1].div_(n)
        means, second_moments = moments.unbind(1)  # (views; no autograd: the batch is detached, rows are buffers)
        stds = torch.addcmul(second_moments, means, means, value=-1).clamp_min_(0.0).sqrt_()
        (batch_mean, memory_mean), (batch_std, memory_std) = means, stds
        target_mean, target_std = self.moments(memory_mean, memory_std, batch_mean, batch_std, batch_size)

        # Eq. 6 as one affine map per dimension: z -> scale * z + shift.
        scale = torch.div(target_std, memory_std).masked_fill_(memory_std <= STD_EPS, 1.0)
        shift = torch.addcmul(target_mean, scale, memory_mean, value=-1)
        gain = getattr(self.moments, "gain", None)
        checked = torch.stack([batch_mean, memory_mean, batch_std, memory_std, scale, shift, target_mean,
                               target_std, *([gain] if gain is not None else [])])
        affine = self._finite_or_identity(checked, checked[4:6])
        rows = self.valid_rows()
        scale32, shift32 = affine.to(rows.dtype)
        torch.addcmul(shift32, rows, scale32, out=rows)

        # The sums follow the map analytically over the rows that stay, m of them:
        # sum' = a sum + m b, sq' = a^2 sq + 2ab sum + m b^2 = a (a sq + 2b sum) + m b^2.
        if dequeued:
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


def _moments(row_sum: torch.Tensor, row_sq_sum: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    mean = row_sum / n
    var = (row_sq_sum / n - mean * mean).clamp_min_(0.0)
    return mean, var.sqrt()
