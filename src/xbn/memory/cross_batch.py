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
- A non-finite target (a NaN gain, an inf in the batch or the memory's moments) raises
  `NonFiniteLossError` before any row is changed. The check reads one flag over the d-vectors of the map,
  fetched in the same host transfer as the step's diagnostics, so it adds no synchronisation on a GPU.
"""

from __future__ import annotations

import torch
from pytorch_metric_learning import losses as pml_losses
from torch import nn

from xbn.utils.errors import NonFiniteLossError

# Dimensions whose memory std is at most this are shifted, not scaled: with sigma[R] = 0 every row equals
# E[R], so Eq. 6 sends it to mu*, and a shift does that without dividing by zero.
STD_EPS = 1e-6


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
        self.last_diagnostics: dict[str, float] = {}
        self.iteration: int | None = None  # the training iteration, set by `Criterion`: named in errors

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
                self.last_diagnostics = {"memory_mean": float(mean.mean()), "memory_std": float(std.mean())}
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

    def _account_dequeued(self, batch_size: int) -> None:
        """Remove from the sums the valid rows that the batch is about to overwrite."""
        idx = torch.arange(self.queue_idx, self.queue_idx + batch_size, device=self.row_sum.device)
        idx = idx % self.memory_size
        if not self.has_been_filled:
            idx = idx[idx < self.queue_idx]  # only rows that wrapped around onto stored ones
        if len(idx):
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
        # The diagnostics and whether the map (4 d-vectors) is finite: one host transfer, before rows move.
        finite = torch.isfinite(torch.cat([target_mean, target_std, scale, shift])).all()
        memory_mean_, memory_std_, batch_mean_, batch_std_, scale_, ok = torch.stack([
            memory_mean.mean(), memory_std.mean(), batch_mean.mean(), batch_std.mean(), scale.mean(),
            finite.double()]).tolist()
        if not ok:
            self._non_finite(target_mean, target_std, batch, memory_mean, memory_std)
        rows = self.valid_rows()
        torch.addcmul(shift.to(rows.dtype), rows, scale.to(rows.dtype), out=rows)

        # The sums follow the same map analytically: sum' = a sum + n b, sq' = a^2 sq + 2ab sum + n b^2.
        new_sq = scale * scale * self.row_sq_sum + 2 * scale * shift * self.row_sum + n * shift * shift
        self.row_sum.mul_(scale).add_(n * shift)
        self.row_sq_sum.copy_(new_sq)
        self.last_diagnostics = {
            **self.moments.diagnostics(),
            "memory_mean": memory_mean_,
            "memory_std": memory_std_,
            "batch_mean": batch_mean_,
            "batch_std": batch_std_,
            "scale": scale_,
        }

    def _non_finite(self, target_mean, target_std, batch, memory_mean, memory_std) -> None:
        def bad(x: torch.Tensor) -> int:
            return int((~torch.isfinite(x)).sum())

        where = (f"iteration {self.iteration}" if self.iteration is not None
                 else f"memory update {self.adaptation_steps + 1}")
        gain = getattr(self.moments, "gain", None)
        what = type(self.moments).__name__.removesuffix("Moments")
        raise NonFiniteLossError(
            f"at {where}: the memory's target moments are not finite (mean: {bad(target_mean)} of "
            f"{target_mean.numel()} dims non-finite, std: {bad(target_std)} of {target_std.numel()}"
            + (f"; {what} gain non-finite in {bad(gain)} dims" if gain is not None else "")
            + f"; batch finite: {bad(batch) == 0}, memory moments finite: "
            f"{bad(memory_mean) + bad(memory_std) == 0}); the memory was left as it was before this update")
