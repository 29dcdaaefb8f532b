"""How a trained model runs at inference (evaluate, index, embed, search, serve): memory format and precision,
chosen once per process (issue 28 items 1 and 2).

On one AVX512-BF16 CPU, tf_efficientnet_lite0 at 224 px embedded 32 img/s in NCHW float32, 49 in channels_last
and 80 in channels_last under bfloat16 autocast; on an AVX2 CPU bfloat16 is emulated and several times slower.
So `inference.precision: auto` uses bfloat16 only where the CPU reports native bf16 (`xbn.utils.cpu`) and a
start-up probe on the model itself measures it faster, and `inference.channels_last: auto` converts where the
probe says so. On CUDA, auto means bfloat16 autocast (as training's `train.amp`) and the format the probe measures
faster (on a batch of 32 there: a GPU timed on 2 images measures kernel launches).

auto keeps bfloat16 only while its embeddings stay within cosine 0.999 of float32, on the probe's images and then
on the first real batch (`run`); whole-network bf16 autocast of the shipped backbone falls short on glyphs
(tests/evaluation/test_inference.py), so there auto runs float32.

Two more steps serve a model faster with the same embeddings (`xbn.evaluation.served`). `fold_batch_norm`
folds each BatchNorm into the convolution before it (exact in float32): tf_efficientnet_lite0 at 224 px under
bf16 autocast went from 119 to 184 img/s at batch 64 and from 115 to 134 at batch 1, one thread. `Compiled`
runs it through torch.compile (inductor, weights frozen as constants, so each activation fuses into its
convolution): 197 img/s at batch 1 against ONNX Runtime's 209 (eager: 122), for a one-off compile of 5 to 15 s
that only a long-running process earns back, so `inference.compile: auto` compiles in `xbn serve`
(`python -m benchmarks serving`, docs/benchmarks.md).

Which engine runs the model, torch in this mode or ONNX Runtime on its exported graph, is `inference.engine`
(`xbn.evaluation.engine`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from xbn.utils import cpu
from xbn.utils.runtime import synchronize

log = logging.getLogger(__name__)
PROBE_PIXELS = 32768  # the probe's batch holds about this many pixels (8 images at 64 px, 2 at 224 px), 2 to 8
CUDA_PROBE_BATCH = 32
PROBE_ROUNDS = 3  # timed forward passes per candidate, after one untimed round
FORMAT_MARGIN = 1.05  # channels_last must beat the default format by this much (ties keep NCHW)
PRECISION_MARGIN = cpu.MARGIN  # bfloat16 must beat float32 by this much: a near tie is not worth its rounding
PARITY_COSINE = 0.999  # and keep every probe embedding within this cosine of float32's (issue 28 item 2)


@dataclass(frozen=True)
class InferenceMode:
    """A memory format and a precision, and what chose them (recorded with the run)."""

    channels_last: bool = False
    bf16: bool = False
    chosen_by: str = "default"
    rates: dict[str, float] = field(default_factory=dict, compare=False)
    bf16_cosine: float | None = field(default=None, compare=False)  # lowest cosine of bf16 to float32 seen

    @property
    def provisional(self) -> bool:
        """bfloat16 chosen on the probe's synthetic images: the first real batch confirms it (`run`)."""
        return self.bf16 and self.chosen_by == "auto: probe"

    def prepare(self, model: nn.Module) -> nn.Module:
        """The model in this mode's memory format (in place, as `Module.to` does)."""
        return model.to(memory_format=torch.channels_last if self.channels_last else torch.contiguous_format)

    def inputs(self, images: torch.Tensor) -> torch.Tensor:
        return images.contiguous(memory_format=torch.channels_last) if self.channels_last else images

    def autocast(self, device: torch.device):
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)

    def record(self) -> dict[str, float]:
        """Numbers only (they go to eval.json, index.json and MLflow): 1/0 flags, the probe's rates and the bf16
        parity it measured."""
        return {"bf16": float(self.bf16), "channels_last": float(self.channels_last),
                **{f"probe_{name}_images_per_s": round(rate, 1) for name, rate in self.rates.items()},
                **({"bf16_min_cosine": round(self.bf16_cosine, 5)} if self.bf16_cosine is not None else {})}

    def describe(self) -> str:
        text = f"{'bfloat16' if self.bf16 else 'float32'}, {'channels_last' if self.channels_last else 'NCHW'}"
        details = [f"{k} {v:.1f} img/s" for k, v in self.rates.items()]
        if self.bf16_cosine is not None:
            details.append(f"bf16 min cosine to float32 {self.bf16_cosine:.4f}")
        return f"{text}{' (' + ', '.join(details) + ')' if details else ''}, chosen by {self.chosen_by}"


FLOAT32 = InferenceMode(chosen_by="params")
_PROBES: dict[tuple, InferenceMode] = {}  # one probe per architecture, device, size and candidate set
_log_once = functools.cache(lambda text: log.info("inference: %s", text))


def choose_inference_mode(model: nn.Module, device: torch.device, image_size: int, precision: str = "auto",
                          channels_last: bool | str = "auto") -> InferenceMode:
    """The mode `model` runs in on `device` at `image_size` for `inference.precision` and
    `inference.channels_last`. A probe runs only when more than one candidate remains; its answer is cached for
    the process (keyed by the model's architecture, not its weights), so later stages agree with the first."""
    device = torch.device(device)
    if precision != "auto":
        precisions, why = [precision == "bfloat16"], "params"
    elif device.type == "cuda":
        precisions, why = [True], "auto: CUDA"
    elif (forced := cpu.forced_bf16()) is not None:
        precisions, why = [forced], f"{cpu.FORCE_ENV}={int(forced)}"
    elif cpu.has_native_bf16():
        precisions, why = [False, True], "auto: probe"
    else:
        precisions, why = [False], "auto: no native bf16 on this CPU"
    # The format is measured on every device: on an H100 a bf16 ResNet-50 ran faster in NCHW than in
    # channels_last (benchmarks/results/gpu.json), against the common advice.
    formats = [bool(channels_last)] if channels_last != "auto" else [False, True]
    # On the CPU bf16 in NCHW is left out when the format is free: it was never the fastest, and at 32 px oneDNN
    # ran it at 1/30 of float32's speed (a 9 s probe). cuDNN's bf16 NCHW kernels have no such hole.
    candidates = tuple((fmt, bf16) for bf16 in precisions for fmt in formats
                       if not (bf16 and not fmt and len(formats) > 1 and device.type == "cpu"))
    if len(candidates) == 1:
        mode = InferenceMode(*candidates[0], chosen_by=why)
        _log_once(mode.describe())
        return mode
    return _probed(_architecture(model), model, device, image_size, candidates)


def _architecture(model: nn.Module) -> tuple:
    return type(model).__name__, sum(p.numel() for p in model.parameters())


def _probed(key: tuple, model: nn.Module, device: torch.device, image_size: int, candidates: tuple) -> InferenceMode:
    cached = _PROBES.get((key, str(device), image_size, candidates))
    if cached is None:
        rates, cosine = probe(model, device, image_size, candidates)
        cached = _PROBES[(key, str(device), image_size, candidates)] = decide(rates, candidates, cosine)
    _log_once(cached.describe())
    return current(cached)


def _name(channels_last: bool, bf16: bool) -> str:
    return f"{'channels_last' if channels_last else 'contiguous'}_{'bf16' if bf16 else 'fp32'}"


def decide(rates: dict[str, float], candidates: tuple, bf16_cosine: float | None = None) -> InferenceMode:
    """The fastest candidate by the margins: channels_last over NCHW by FORMAT_MARGIN, bfloat16 over the best
    float32 by PRECISION_MARGIN and only when its embeddings kept `PARITY_COSINE` to float32's in the probe."""
    def best_format(bf16: bool) -> tuple[bool, float] | None:
        options = {fmt: rates[_name(fmt, bf16)] for fmt, b in candidates if b == bf16}
        if not options:
            return None
        if True in options and False in options:
            fmt = options[True] > FORMAT_MARGIN * options[False]
            return fmt, options[fmt]
        (fmt, rate), = options.items()
        return fmt, rate

    fp32, bf16 = best_format(False), best_format(True)
    accurate = bf16_cosine is None or bf16_cosine >= PARITY_COSINE
    use_bf16 = fp32 is None or (bf16 is not None and accurate and bf16[1] > PRECISION_MARGIN * fp32[1])
    chosen = bf16 if use_bf16 else fp32
    assert chosen is not None  # candidates are never empty
    fmt = chosen[0]
    return InferenceMode(fmt, use_bf16, "auto: probe", rates, bf16_cosine)


def probe_images(batch: int, image_size: int, device: torch.device) -> torch.Tensor:
    """Smooth random images (8x8 noise upsampled bicubically, in the normalised range): closer to photographs
    than white noise, whose bf16 error is not what real inputs see. From a generator of its own: the global RNG
    is untouched."""
    generator = torch.Generator().manual_seed(0)
    coarse = torch.rand(batch, 3, 8, 8, generator=generator) * 2 - 1
    return F.interpolate(coarse, size=image_size, mode="bicubic", align_corners=False).clamp(-1, 1).to(device)


@torch.inference_mode()
def probe(model: nn.Module, device: torch.device, image_size: int,
          candidates: tuple) -> tuple[dict[str, float], float | None]:
    """(images per second of `model`'s forward pass for each (channels_last, bf16) candidate, the lowest cosine
    of a bf16 candidate's output to the first float32 candidate's, None without both). One untimed round
    (kernel selection, first-call costs), then PROBE_ROUNDS rounds that time each candidate in turn, best round
    kept, so a burst of load elsewhere hits every candidate alike. The model's memory format is restored after."""
    batch = CUDA_PROBE_BATCH if device.type == "cuda" else max(2, min(8, round(PROBE_PIXELS / image_size**2)))
    images = probe_images(batch, image_size, device)
    was_training = model.training
    model.eval()
    best = dict.fromkeys(candidates, float("inf"))
    outputs: dict[tuple, torch.Tensor] = {}
    try:
        for round_ in range(PROBE_ROUNDS + 1):
            for fmt, bf16 in candidates:
                mode = InferenceMode(fmt, bf16)
                x = mode.inputs(images)
                mode.prepare(model)
                with mode.autocast(device):
                    synchronize(device)
                    start = time.perf_counter()
                    out = model(x)
                    synchronize(device)
                if round_:
                    best[fmt, bf16] = min(best[fmt, bf16], time.perf_counter() - start)
                else:
                    outputs[fmt, bf16] = out.float()
    finally:
        model.to(memory_format=torch.contiguous_format)
        model.train(was_training)
    rates = {_name(*candidate): batch / seconds for candidate, seconds in best.items()}
    reference = next((out for (_, bf16), out in outputs.items() if not bf16), None)
    cosines = [F.cosine_similarity(out, reference, dim=1).min().item()
               for (_, bf16), out in outputs.items() if bf16 and reference is not None]
    return rates, (min(cosines) if cosines else None)


_real_cosine: list[float] = []  # the first real batch's bf16 parity, once measured in this process


def settled(mode: InferenceMode) -> bool:
    """Whether `mode` is final: not a provisional bf16 still awaiting its first real batch (`run`)."""
    return not mode.provisional or bool(_real_cosine)


def current(mode: InferenceMode) -> InferenceMode:
    """`mode`, or its float32 twin when real images in this process already refuted its provisional bf16."""
    if mode.provisional and _real_cosine and _real_cosine[0] < PARITY_COSINE:
        return replace(mode, bf16=False, bf16_cosine=_real_cosine[0],
                       chosen_by=f"auto: bf16 refused on real images (cosine {_real_cosine[0]:.4f} < {PARITY_COSINE})")
    return mode


@torch.inference_mode()
def run(model: nn.Module, images: torch.Tensor, mode: InferenceMode, device: torch.device
        ) -> tuple[torch.Tensor, InferenceMode]:
    """`model`'s float32 output on a batch in `mode`, and the mode to go on with. The probe's images are
    synthetic, so a provisional bf16 is checked once per process on the first real batch against float32: below
    PARITY_COSINE (tf_efficientnet_lite0 gave 0.974 on glyphs at 64 px, 0.999+ on the probe's images) this
    process falls back to float32 and says so."""
    mode = current(mode)
    with mode.autocast(device):
        out = model(mode.inputs(images)).float()
    if mode.provisional and not _real_cosine:
        exact = model(mode.inputs(images)).float()
        _real_cosine.append(F.cosine_similarity(out, exact, dim=1).min().item())
        mode = current(mode)
        if not mode.bf16:
            log.warning("inference: %s", mode.describe())
            out = exact
    return out, mode


M = TypeVar("M", bound=nn.Module)


def fold_batch_norm(model: M, example: torch.Tensor) -> M:
    """A copy of `model` in eval mode in which every BatchNorm2d that reads a Conv2d's output is folded into that
    convolution's weight and bias (`torch.nn.utils.fusion.fuse_conv_bn_weights`), keeping the activation of
    timm's BatchNormAct2d. Which convolution feeds which BatchNorm is read from one forward pass on `example`
    (folded only when the BatchNorm's input is the very tensor the convolution returned), because timm's
    same-padding convolutions defeat torch.fx tracing. If the folded copy's output on `example` is not the
    original's (a convolution whose output is also read elsewhere, a shared module), `model` is returned as is."""
    from timm.layers import BatchNormAct2d
    from torch.nn.utils.fusion import fuse_conv_bn_weights

    folded = copy.deepcopy(model).eval()
    returned: dict[int, tuple[nn.Conv2d, torch.Tensor]] = {}  # the last convolution's output, by identity
    pairs: list[tuple[nn.Conv2d, nn.BatchNorm2d]] = []

    def after_conv(conv, _, out):
        returned.clear()
        returned[id(out)] = conv, out

    def after_norm(norm, inputs, _):
        conv, out = returned.pop(id(inputs[0]), (None, None))
        if conv is not None and out is inputs[0] and type(norm) in (nn.BatchNorm2d, BatchNormAct2d) \
                and norm.track_running_stats:
            pairs.append((conv, norm))

    hooks = [m.register_forward_hook(after_conv if isinstance(m, nn.Conv2d) else after_norm)
             for m in folded.modules() if isinstance(m, (nn.Conv2d, nn.BatchNorm2d))]
    with torch.no_grad():
        expected = folded(example)
    for hook in hooks:
        hook.remove()
    if len({id(conv) for conv, _ in pairs}) != len(pairs):  # a convolution called twice: leave the model alone
        return model
    names = {id(m): name for name, m in folded.named_modules()}
    for conv, norm in pairs:
        assert norm.running_mean is not None and norm.running_var is not None  # track_running_stats
        conv.weight, conv.bias = fuse_conv_bn_weights(conv.weight, conv.bias, norm.running_mean, norm.running_var,
                                                      norm.eps, norm.weight, norm.bias)
        after = [m for m in (getattr(norm, "drop", None), getattr(norm, "act", None)) if m is not None]
        parent, _, child = names[id(norm)].rpartition(".")
        setattr(folded.get_submodule(parent), child, nn.Sequential(*after) if after else nn.Identity())
    with torch.no_grad():
        exact = torch.allclose(folded(example), expected, rtol=1e-3, atol=1e-4)
    if not exact:
        log.warning("inference: folding BatchNorm changed %s's output: running it unfolded", type(model).__name__)
        return model
    return folded


class Compiled(nn.Module):
    """`model` through torch.compile's inductor with its weights frozen as constants (inference only:
    BatchNorm folds, each activation fuses into its oneDNN convolution, bf16 weights are cast once). Compiles on
    its first call, and again for a second batch shape (then with a dynamic batch); on the CPU it needs a C++
    compiler (`ServedModel` falls back to eager when compiling fails). Freezing is set around each call rather
    than in torch.compile's `options`, which in torch 2.14 did not freeze (160 against 237 img/s at batch 1)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.compiled = torch.compile(model)
        if not torch.cuda.is_available():  # inductor's "No CUDA runtime is found" says nothing on a CPU machine
            logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        from torch._inductor import config

        with config.patch(freezing=True):
            return self.compiled(images)


def resolve_compile(setting: bool | str, long_running: bool) -> bool:
    """`inference.compile`: auto compiles only a long-running process's model (`xbn serve`), where one compile
    serves every request after it (on the CPU 1.6x the eager rate at batch 1; on an H200, ResNet-50 at batch 64,
    1.8x: benchmarks/results/gpu.json); true and false force it."""
    return long_running if setting == "auto" else bool(setting)


def inference_mode(params: Any, model: nn.Module, device: torch.device) -> InferenceMode:
    """The mode for `params.inference` (see the module docstring), the model prepared for it."""
    cfg = params.inference
    mode = choose_inference_mode(model, device, params.data.image_size, cfg.precision, cfg.channels_last)
    mode.prepare(model)
    return mode


__all__ = [
    "FLOAT32",
    "Compiled",
    "InferenceMode",
    "choose_inference_mode",
    "current",
    "decide",
    "fold_batch_norm",
    "inference_mode",
    "probe",
    "resolve_compile",
    "run",
    "settled",
]
