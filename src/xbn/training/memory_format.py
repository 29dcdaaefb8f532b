"""channels_last or not: where it is faster depends on the device and on the CPU's kernels (issue 28: 1.75x for a
training step on one AVX512 CPU, about 1.05x on an AVX2 one), so `train.channels_last: auto` measures it.

On every device a probe times a few forward and backward passes of the model on a batch of the training shape
and precision (bf16 autocast when `train.amp` applies) in each format, and keeps the faster. CUDA is no
exception: on an H100, ResNet-50 at 224 px, batch 64 under bf16 trained 1.17x faster in NCHW than in channels_last
(benchmarks/results/gpu.json, 5 interleaved rounds), against the common advice. The probe leaves the run as it
was: its input comes from a generator of its own (the global RNG is untouched), the model is in eval mode
(BatchNorm statistics do not move) and its gradients are dropped afterwards.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from xbn.evaluation.embed import autocast
from xbn.utils.runtime import synchronize

log = logging.getLogger(__name__)
PROBE_STEPS = 3  # timed rounds (a pass in each format), after one untimed round
MARGIN = 1.05  # channels_last must be this much faster to be chosen (ties stay in the default format)


def choose_channels_last(setting: bool | str, model: nn.Module, device: torch.device, batch: int,
                         image_size: int, amp: bool = False) -> tuple[bool, dict]:
    """(whether to use channels_last, what decided it) for `train.channels_last` = `setting`; `amp`: the
    training step runs under bf16 autocast, so the probe does too."""
    if setting != "auto":
        return bool(setting), {"channels_last": bool(setting), "chosen_by": "params"}
    rates = probe(model, device, min(batch, 32), image_size, amp)
    chosen = rates["channels_last"] > MARGIN * rates["contiguous"]
    return chosen, {"channels_last": chosen, "chosen_by": "auto: probe",
                    **{f"probe_{k}_images_per_s": round(v, 1) for k, v in rates.items()}}


def probe(model: nn.Module, device: torch.device, batch: int, image_size: int,
          amp: bool = False) -> dict[str, float]:
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
                synchronize(device)
                start = time.perf_counter()
                with autocast(device, amp):
                    loss = model(x).float().sum()
                loss.backward()
                synchronize(device)
                if round_:
                    best[name] = min(best[name], time.perf_counter() - start)
    finally:
        model.zero_grad(set_to_none=True)
        model.to(memory_format=torch.contiguous_format)
        model.train(was_training)
    return {name: batch / seconds for name, seconds in best.items()}


__all__ = ["choose_channels_last", "probe"]
