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
