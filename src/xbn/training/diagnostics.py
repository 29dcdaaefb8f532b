"""Feature drift (seed 000, Eq. 5): how far the embeddings of a fixed probe batch move between two checks,
D = ||f(x; theta_k) - f(x; theta_{k - dk})||, reported as the mean and the max over the probe images."""

from __future__ import annotations

import torch
from torch import nn


class FeatureDrift(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("previous", torch.empty(0))
        self.last_iteration = -1

    def get_extra_state(self):
        return {"last_iteration": self.last_iteration}

    def set_extra_state(self, state):
        self.last_iteration = int(state["last_iteration"])

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # The probe embeddings' shape is only known after the first check.
        key = prefix + "previous"
        if key in state_dict:
            self.previous = torch.empty_like(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @torch.no_grad()
    def update(self, model: nn.Module, probe: torch.Tensor, iteration: int) -> dict[str, float]:
        was_training = model.training
        model.eval()
        current = model(probe).float()
        model.train(was_training)
        out: dict[str, float] = {}
        if self.previous.numel():
            distance = (current - self.previous.to(current.device)).norm(dim=1)
            out = {"drift_mean": float(distance.mean()), "drift_max": float(distance.max()),
                   "drift_interval": iteration - self.last_iteration}
        self.previous = current
        self.last_iteration = iteration
        return out


# The memory's own drift (seed 000 Sec. 5, Fig. 2; issue 42), in train_steps.csv beside the probe's drift.
MEMORY_DRIFT_COLUMNS = ["memory_rows_checked", "memory_age", "stored_drift_mean", "stored_drift_max",
                        "stored_cosine", "mapped_drift_mean", "mapped_drift_max", "mapped_cosine", "scale_min",
                        "scale_median", "scale_max", "batch_mean_noise"]


@torch.no_grad()
def memory_drift(memory, embed, iteration: int, rows: int) -> dict[str, float]:
    """How stale the memory is, written by hand (the seed measures it, no library does): for up to `rows` of
    the memory's tracked slots (fixed slots; the oracle tracks them all), the distance between the current
    model's embedding of a row's stored input, `embed(view)`, and
      - the row as it was written (`stored_*`: what XBM compares with), and
      - the row as the loss sees it now (`mapped_*`: after XBN/AXBN/EMA's maps; equal to stored for XBM),
    as the mean and max Euclidean distance and the mean cosine; the rows' mean age in steps; the last map's
    per-dimension scale (min, median, max); and the spread of the batch mean since the last check
    (`CrossBatchMemory.take_batch_noise`). {} while no tracked slot holds a row."""
    stored = memory.stored
    valid = stored.valid(memory.num_valid)
    if len(valid) > rows:
        valid = valid[torch.linspace(0, len(valid) - 1, rows).long()]
    noise = memory.take_batch_noise()
    if not len(valid):
        return {}
    fresh = torch.cat([embed(stored.decode(part)) for part in valid.split(256)]).float()
    on = fresh.device
    written = stored.raw[valid.to(stored.raw.device)].float().to(on)
    mapped = memory.embedding_memory[stored.slots[valid].to(memory.embedding_memory.device)].float().to(on)
    out: dict[str, float] = {"memory_rows_checked": len(valid),
                             "memory_age": float(iteration - stored.written_at[valid].double().mean())}
    for name, rows_now in (("stored", written), ("mapped", mapped)):
        distance = (rows_now - fresh).norm(dim=1)
        out[f"{name}_drift_mean"] = float(distance.mean())
        out[f"{name}_drift_max"] = float(distance.max())
        out[f"{name}_cosine"] = float(torch.nn.functional.cosine_similarity(rows_now, fresh, dim=1).mean())
    if (scale := memory.last_scale()) is not None:
        low, mid, high = torch.quantile(scale.float(), torch.tensor([0.0, 0.5, 1.0], device=scale.device)).tolist()
        out.update(scale_min=low, scale_median=mid, scale_max=high)
    if noise is not None:
        out["batch_mean_noise"] = noise
    return out


def summarize_memory_drift(steps: list[dict]) -> dict | None:
    """train.json's `memory_drift`: over the checks, the mean of each distance and cosine, and the fraction of
    checks where the mapped rows were closer to the fresh embeddings than the stored ones (Fig. 2's claim)."""
    checks = [s for s in steps if s.get("stored_drift_mean") is not None]
    if not checks:
        return None
    def mean(key: str) -> float:
        return round(sum(s[key] for s in checks) / len(checks), 6)
    closer = sum(s["mapped_drift_mean"] < s["stored_drift_mean"] for s in checks) / len(checks)
    return {"checks": len(checks), "stored_drift_mean": mean("stored_drift_mean"),
            "mapped_drift_mean": mean("mapped_drift_mean"), "stored_cosine": mean("stored_cosine"),
            "mapped_cosine": mean("mapped_cosine"), "memory_age": mean("memory_age"),
            "mapped_closer_fraction": round(closer, 4)}
