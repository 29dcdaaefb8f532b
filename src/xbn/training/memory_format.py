"""channels_last or not: where it is faster depends on the device and on the CPU's kernels (issue 28: 1.75x for a
training step on one AVX512 CPU, about 1.05x on an AVX2 one), so `train.channels_last: auto` measures it.

On CUDA, auto means channels_last (cuDNN's convolutions prefer it). On the CPU a probe times a few forward and
backward passes of the model on a batch of the training shape in each format, and keeps the faster. The probe
leaves the run as it was: its input comes from a generator of its own (the global RNG is untouched), the model is
in eval mode (BatchNorm statistics do not move) and its gradients are dropped afterwards.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

log = logging.getLogger(__name__)
PROBE_STEPS = 3  # timed rounds (a pass in each format), after one untimed round
MARGIN = 1.05  # channels_last must be this much faster to be chosen (ties stay in the default format)


def choose_channels_last(setting: bool | str, model: nn.Module, device: torch.device, batch: int,
                         image_size: int) -> tuple[bool, dict]:
    """(whether to use channels_last, what decided it) for `train.channels_last` = `setting`."""
    if setting != "auto":
        return bool(setting), {"channels_last": bool(setting), "chosen_by": "params"}
    if device.type == "cuda":
        return True, {"channels_last": True, "chosen_by": "auto: CUDA"}
    rates = probe(model, device, min(batch, 32), image_size)
    chosen = rates["channels_last"] > MARGIN * rates["contiguous"]
    return chosen, {"channels_last": chosen, "chosen_by": "auto: probe",
                    **{f"probe_{k}_images_per_s": round(v, 1) for k, v in rates.items()}}


def probe(model: nn.Module, device: torch.device, batch: int, image_size: int) -> dict[str, float]:
    """Training images per second of `model` in each memory format (forward and backward passes): one untimed
    round per format (kernel selection, first-call costs), then PROBE_STEPS rounds that time each format in turn,
    the best round kept, so a burst of load elsewhere hits both formats alike."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, image_size, image_size, generator=generator).to(device)
    formats = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
    was_training = model.training
    model.eval()
    best = dict.fromkeys(formats, float("inf"))
    try:
        for round_ in range(PROBE_STEPS + 1):
            for name, fmt in formats.items():
                model.to(memory_format=fmt)
                x = images.contiguous(memory_format=fmt)
                start = time.perf_counter()
                model(x).sum().backward()
                if round_:
                    best[name] = min(best[name], time.perf_counter() - start)
    finally:
        model.zero_grad(set_to_none=True)
        model.to(memory_format=torch.contiguous_format)
        model.train(was_training)
    return {name: batch / seconds for name, seconds in best.items()}


__all__ = ["choose_channels_last", "probe"]
