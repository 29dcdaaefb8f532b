"""What the memory path did, step by step (issue 52: a memory loss that sits at 0 must show): the memory loss and
the minibatch loss apart, the pairs mined against the memory, and how spread the batch's embeddings are and
where they sit against the memory's rows. Summed on the device every step and read only when the trainer logs
(`take`) or closes a `train.stall` window (`take_zero_steps`), so no step waits for the device."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The step rows' columns (means over the steps since the last read; empty without a memory).
FIGURE_COLUMNS = ["memory_loss", "batch_loss", "memory_positives", "memory_negatives", "memory_no_positive",
                  "batch_mean_norm", "batch_cosine", "batch_memory_cosine"]


@torch.no_grad()
def spread(embeddings: torch.Tensor, memory_mean: torch.Tensor) -> torch.Tensor:
    """[the norm of the batch's mean unit embedding, the mean cosine over its distinct pairs, the cosine between
    the batch's mean and `memory_mean`]: 1, 1 and 1 when every image maps to one point that the memory holds too.
    The mean pairwise cosine comes from the sum: |sum u|^2 = B + sum over ordered pairs i != j of cos(u_i, u_j)."""
    units = F.normalize(embeddings.detach().float(), dim=1)
    b = len(units)
    mean = units.mean(0)
    total = mean.mul(b).square().sum()
    pair_cosine = (total - b) / max(b * (b - 1), 1)
    return torch.stack([mean.norm(), pair_cosine,
                        F.cosine_similarity(mean, memory_mean.to(mean), dim=0)])


class StepFigures:
    def __init__(self) -> None:
        self._sums: torch.Tensor | None = None  # [memory loss, batch loss, *spread]
        self._zero: torch.Tensor | None = None  # steps whose memory loss was exactly 0
        self._pairs = [0, 0, 0, 0]  # positives, negatives, steps with no positive, steps mined (host: shapes)
        self._steps = self._batch_steps = 0

    def add(self, memory, embeddings: torch.Tensor, memory_loss: torch.Tensor,
            batch_loss: torch.Tensor | None) -> None:
        """One step of the memory path: `memory` after its forward (its rows hold the batch)."""
        memory_mean = memory.row_sum / max(memory.num_valid, 1)
        row = torch.cat([torch.stack([memory_loss.detach().float(),
                                      (batch_loss if batch_loss is not None else memory_loss).detach().float()]),
                         spread(embeddings, memory_mean)])
        if self._sums is None or self._sums.device != row.device:
            self._sums, self._zero = torch.zeros_like(row), torch.zeros((), device=row.device)
        assert self._zero is not None
        if batch_loss is None:
            row[1] = 0.0
        self._sums.add_(row)
        self._zero.add_(memory_loss.detach() == 0)
        self._steps += 1
        self._batch_steps += batch_loss is not None
        if memory.last_pairs is not None:
            positives, negatives = memory.last_pairs
            self._pairs[0] += positives
            self._pairs[1] += negatives
            self._pairs[2] += positives == 0
            self._pairs[3] += 1
            memory.last_pairs = None

    def take(self) -> dict[str, float]:
        """Means over the steps since the last call (FIGURE_COLUMNS); {} if there were none."""
        if not self._steps or self._sums is None:
            return {}
        n = self._steps
        loss, batch, *spread_sums = self._sums.tolist()
        positives, negatives, no_positive, mined = self._pairs
        out = {"memory_loss": loss / n, **({"batch_loss": batch / self._batch_steps} if self._batch_steps else {}),
               **({"memory_positives": positives / mined, "memory_negatives": negatives / mined,
                   "memory_no_positive": no_positive / mined} if mined else {}),
               **dict(zip(("batch_mean_norm", "batch_cosine", "batch_memory_cosine"), (v / n for v in spread_sums)))}
        self._sums.zero_()
        self._pairs = [0, 0, 0, 0]
        self._steps = self._batch_steps = 0
        return out

    def take_zero_steps(self) -> int:
        """Steps whose memory loss was exactly 0 since the last call."""
        if self._zero is None:
            return 0
        zero = int(self._zero)
        self._zero.zero_()
        return zero
