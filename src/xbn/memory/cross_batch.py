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
- The queue pointer and fill flag live in `state_dict` (PML keeps them as plain attributes, so a resumed run
  would silently differ).
- No step waits for the device: counters are Python ints, the diagnostics stay 0-d device tensors until the
  trainer logs them (every `train.log_every` steps), and the finiteness of the map is decided on the device.
  A non-finite target (a NaN gain, an inf in the batch or the memory's moments) leaves every row as it was
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
# What `_adapt` records about the first non-finite update: where, then counts of non-finite values.
NON_FINITE_FIELDS = ("at", "is_iteration", "target_mean", "target_std", "gain", "batch", "memory_moments")


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
        self.last_diagnostics: dict[str, float | torch.Tensor] = {}
        self.iteration: int | None = None  # the training iteration, set by `Criterion`: named in errors
        # The first non-finite update, recorded on the device (see `check_finite`); not state: a run stops at it.
        self.non_finite = torch.full((len(NON_FINITE_FIELDS),), -1.0, dtype=torch.float64)

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
        n = max(self.num_valid, 1)
        mean = self.row_sum / n
        var = (self.row_sq_sum / n - mean * mean).clamp_min_(0.0)
        return mean, var.sqrt()

    def refresh_sums(self) -> None:
        rows = self.valid_rows().double()
        self.row_sum.copy_(rows.sum(0))
        self.row_sq_sum.copy_((rows * rows).sum(0))

    # -- the memory update ----------------------------------------------------------------------------------
    def add_to_memory(self, embeddings, labels, batch_size):
        embeddings = embeddings.detach()
        self._move_sums(embeddings.device)
        if self.num_valid > 0:
            if self.adaptation_steps % self.refresh_interval == 0:
                self.refresh_sums()
            if self.moments is not None:
                self._adapt(embeddings)
            else:  # xbm: rows stay as written; the moments are still worth watching
                mean, std = self.memory_moments()
                self.last_diagnostics = {"memory_mean": mean.mean(), "memory_std": std.mean()}
            self.adaptation_steps += 1
        self._account_dequeued(batch_size)
        super().add_to_memory(embeddings, labels, batch_size)
        new_rows = embeddings.double()
        self.row_sum += new_rows.sum(0)
        self.row_sq_sum += (new_rows * new_rows).sum(0)

    def _move_sums(self, device: torch.device) -> None:
        # PML moves the memory to the batch's device in forward(); the sums must follow it.
        if self.row_sum.device != device:
            self.row_sum = self.row_sum.to(device)
            self.row_sq_sum = self.row_sq_sum.to(device)
            self.non_finite = self.non_finite.to(device)

    def _account_dequeued(self, batch_size: int) -> None:
        """Remove from the sums the valid rows that the batch is about to overwrite (counted in Python: a
        boolean mask would make the host wait for the device)."""
        start = self.queue_idx
        if self.has_been_filled:
            idx = torch.arange(start, start + batch_size, device=self.row_sum.device) % self.memory_size
        else:  # only the rows that wrap around onto stored ones: positions 0 .. start + B - M - 1
            wrapped = start + batch_size - self.memory_size
            if wrapped <= 0:
                return
            idx = torch.arange(wrapped, device=self.row_sum.device)
        old = self.embedding_memory[idx].double()
        self.row_sum -= old.sum(0)
        self.row_sq_sum -= (old * old).sum(0)

    @torch.no_grad()
    def _adapt(self, batch: torch.Tensor) -> None:
        n = self.num_valid
        memory_mean, memory_std = self.memory_moments()
        batch64 = batch.double()
        batch_mean = batch64.mean(0)
        batch_std = batch64.std(0, unbiased=False)
        target_mean, target_std = self.moments(memory_mean, memory_std, batch_mean, batch_std, len(batch))

        # Eq. 6 as one affine map per dimension: z -> scale * z + shift.
        degenerate = memory_std <= STD_EPS
        scale = torch.where(degenerate, torch.ones_like(memory_std), target_std / memory_std.clamp_min(STD_EPS))
        shift = target_mean - scale * memory_mean
        # A non-finite map is recorded and replaced by the identity, decided on the device (no host wait).
        finite = torch.isfinite(torch.cat([target_mean, target_std, scale, shift])).all()
        self._record_non_finite(finite, target_mean, target_std, batch64, memory_mean, memory_std)
        scale = torch.where(finite, scale, torch.ones_like(scale))
        shift = torch.where(finite, shift, torch.zeros_like(shift))
        diagnostics = {"memory_mean": memory_mean.mean(), "memory_std": memory_std.mean(),
                       "batch_mean": batch_mean.mean(), "batch_std": batch_std.mean(), "scale": scale.mean()}
        rows = self.valid_rows()
        torch.addcmul(shift.to(rows.dtype), rows, scale.to(rows.dtype), out=rows)

        # The sums follow the same map analytically: sum' = a sum + n b, sq' = a^2 sq + 2ab sum + n b^2.
        new_sq = scale * scale * self.row_sq_sum + 2 * scale * shift * self.row_sum + n * shift * shift
        self.row_sum.mul_(scale).add_(n * shift)
        self.row_sq_sum.copy_(new_sq)
        self.last_diagnostics = {**self.moments.diagnostics(), **diagnostics}

    def _record_non_finite(self, finite, target_mean, target_std, batch, memory_mean, memory_std) -> None:
        """Keep, on the device, where the first non-finite update happened and what was non-finite in it."""
        def bad(x: torch.Tensor) -> torch.Tensor:
            return (~torch.isfinite(x)).sum().double()

        device = finite.device
        at, is_iteration = ((self.iteration, 1.0) if self.iteration is not None
                            else (self.adaptation_steps + 1, 0.0))
        gain = getattr(self.moments, "gain", None)
        report = torch.stack([
            torch.full((), float(at), dtype=torch.float64, device=device),
            torch.full((), is_iteration, dtype=torch.float64, device=device),
            bad(target_mean), bad(target_std),
            bad(gain) if gain is not None else torch.full((), -1.0, dtype=torch.float64, device=device),
            bad(batch), bad(memory_mean) + bad(memory_std)])
        first = ~finite & (self.non_finite[0] < 0)
        self.non_finite = torch.where(first, report, self.non_finite)

    def check_finite(self) -> None:
        """Raise `NonFiniteLossError` if an update since the start had a non-finite target (one host read)."""
        report = dict(zip(NON_FINITE_FIELDS, self.non_finite.tolist()))
        if report["at"] < 0:
            return
        where = f"{'iteration' if report['is_iteration'] else 'memory update'} {int(report['at'])}"
        what = type(self.moments).__name__.removesuffix("Moments")
        d = self.embedding_size
        gain = (f"; {what} gain non-finite in {int(report['gain'])} dims" if report["gain"] >= 0 else "")
        raise NonFiniteLossError(
            f"at {where}: the memory's target moments are not finite (mean: {int(report['target_mean'])} of "
            f"{d} dims non-finite, std: {int(report['target_std'])} of {d}{gain}; batch finite: "
            f"{report['batch'] == 0}, memory moments finite: {report['memory_moments'] == 0}); the memory's "
            f"rows were left as they were from this update on")
