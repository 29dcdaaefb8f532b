"""Training throughput on a GPU: ResNet-50, 224 px, batch 64, bfloat16 autocast, channels_last; real vs synthetic.

    python -m benchmarks gpu [--quick] [--steps 30] [--warmup 5] [--num-workers auto] [--pipelines cache pil]

The trainer's own pieces (`xbn.training.trainer.Trainer` with `model.backbone=resnet50 model.pretrained=none
data.image_size=224 train.device=cuda train.amp=true train.channels_last=true`, the memory criterion of
params.yaml) on the generated glyph set (rendered at 224 px). Two rates, images/s:
  synthetic  one batch already on the GPU, reused: the model + loss + optimizer alone
  real       the training loader feeding the GPU (decode, augment, pin, copy), as in `Trainer._train_epoch`
Their ratio says whether the input pipeline keeps the GPU busy (issue 44 item 1: real / synthetic >= 0.9). `real`
is measured for each input pipeline of `--pipelines`, interleaved over `--rounds` rounds: `cache` (the decode
cache, `data.cache=true`, with the batch stage of the augmentation on the GPU, `data.augment_on=device`; built
once before the rounds, its time reported apart) and `pil` (`data.cache=false`: PIL decode and timm's transform
in the workers, the reference); the first pipeline named is the headline `real_images_per_s`. `variants` gives the synthetic rate of the same
model in fp32 NCHW, bf16 NCHW and bf16 channels_last, interleaved over `--rounds` rounds (issue 28: is each
choice faster on a GPU too?), and `channels_last_auto` what `train.channels_last=auto`'s start-up probe chose;
`inference` the same for the embedder's forward pass, and what `inference.*: auto` chose. Without CUDA it keeps
an earlier GPU result and otherwise writes `status: not run`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import machine_info, read_result, write_result
from benchmarks.verdicts import verdict

PACKAGES = ("torch", "torchvision", "timm", "pytorch-metric-learning")
TARGET = 0.9  # real / synthetic images/s (issue 44 item 1): the input pipeline keeps the GPU fed


def _rate(trainer, batches, steps: int, warmup: int) -> float:
    it = iter(batches)
    for _ in range(warmup):
        images, labels, *_ = next(it)
        trainer.step(images, labels)
    torch.cuda.synchronize()
    start, n = time.perf_counter(), 0
    for _ in range(steps):
        images, labels, *_ = next(it)
        trainer.step(images, labels)
        n += len(images)
    torch.cuda.synchronize()
    return n / (time.perf_counter() - start)


def _repeat(batch):
    while True:
        yield batch


def _cycle(loader):
    while True:
        yield from loader


VARIANTS = {"fp32_nchw": (False, False), "bf16_nchw": (True, False), "bf16_channels_last": (True, True)}


def _variants(trainer, batch, steps: int, warmup: int, rounds: int) -> dict[str, dict[str, Any]]:
    """Synthetic images/s with autocast and memory format switched on the one trainer, in `rounds` interleaved
    rounds (a drift of the GPU's clock or of the host hits every variant alike); each variant's median, and its
    ratio to fp32 NCHW in each round. The trainer's own settings are restored afterwards."""
    amp, channels_last = trainer.amp, trainer.channels_last
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name, (use_amp, use_cl) in VARIANTS.items():
            trainer.amp, trainer.channels_last = use_amp, use_cl
            trainer.model.to(memory_format=torch.channels_last if use_cl else torch.contiguous_format)
            rates[name].append(_rate(trainer, _repeat(batch), steps, warmup))
    trainer.amp, trainer.channels_last = amp, channels_last
    trainer.model.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    return _summary(rates)


def _summary(rates: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """Each variant's median images/s over the rounds, and its ratio to fp32 NCHW's in each round."""
    base = rates["fp32_nchw"]
    return {name: {"median_images_per_s": round(statistics.median(r), 1),
                   "vs_fp32_nchw_per_round": [round(a / b, 3) for a, b in zip(r, base)]}
            for name, r in rates.items()}


@torch.inference_mode()
def _inference_variants(model: torch.nn.Module, images: torch.Tensor, rounds: int, passes: int = 20) -> dict:
    """Forward-pass images/s of the embedder in each (format, precision), interleaved over `rounds` rounds, and
    what `inference.channels_last/precision: auto` choose on this device (`xbn.evaluation.inference`)."""
    from xbn.evaluation.inference import InferenceMode, choose_inference_mode

    was_training = model.training
    model.eval()
    rates: dict[str, list[float]] = {}
    for _ in range(rounds):
        for (channels_last, bf16) in ((False, False), (False, True), (True, True)):
            mode = InferenceMode(channels_last, bf16)
            x = mode.inputs(images)
            mode.prepare(model)
            with mode.autocast(images.device):
                model(x)  # first call of this format: cuDNN's kernel choice
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(passes):
                    model(x)
                torch.cuda.synchronize()
            name = f"{'bf16' if bf16 else 'fp32'}_{'channels_last' if channels_last else 'nchw'}"
            rates.setdefault(name, []).append(passes * len(images) / (time.perf_counter() - start))
    model.to(memory_format=torch.contiguous_format)
    chosen = choose_inference_mode(model, images.device, images.shape[-1])
    model.train(was_training)
    return {"batch": len(images), "chosen": {"channels_last": chosen.channels_last, "bf16": chosen.bf16,
                                             "chosen_by": chosen.chosen_by, **chosen.record()},
            **_summary(rates)}


@torch.inference_mode()
def _served_paths(model: torch.nn.Module, data_config: dict, images: torch.Tensor, rounds: int,
                  passes: int = 20) -> dict:
    """The served embedder on this GPU (`xbn.evaluation.served`: BatchNorm folded, `inference.*: auto`), eager
    and compiled (`inference.compile: true`, what auto gives `xbn serve`), images/s interleaved over `rounds`
    rounds after two first calls each (timed: the mode's parity check, the compile), and each one's lowest cosine to
    the unfolded float32 model's embeddings of the same batch."""
    import torch.nn.functional as F

    from xbn.serving.model import served

    model.eval().to(memory_format=torch.contiguous_format)
    reference = model(images).float().cpu()
    runners = {name: served(model, data_config, images.shape[-1], device=images.device, compile=name == "compiled")
               for name in ("eager", "compiled")}
    first_call_s, cosine = {}, {}
    for name, runner in runners.items():  # the parity check of a provisional bf16, then the compile
        seconds = []
        for _ in range(2):
            start = time.perf_counter()
            out = torch.from_numpy(runner.embed_tensors(images))
            seconds.append(round(time.perf_counter() - start, 2))
        first_call_s[name] = seconds
        cosine[name] = round(F.cosine_similarity(out, reference).min().item(), 5)
    rates: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, runner in runners.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(passes):
                runner.embed_tensors(images)  # returns host memory: waits for the GPU
            rates.setdefault(name, []).append(passes * len(images) / (time.perf_counter() - start))
    mode = runners["eager"].mode
    return {"batch": len(images), "mode": mode.describe(), "compile_kept": runners["compiled"].compile,
            "first_call_s": first_call_s, "min_cosine_to_unfolded_fp32": cosine,
            **{name: {"median_images_per_s": round(statistics.median(r), 1),
                      "vs_eager_per_round": [round(a / b, 3) for a, b in zip(r, rates["eager"])]}
               for name, r in rates.items()}}


def _measured(name: str) -> dict[str, Any] | None:
    """The results file `name` when it holds a GPU measurement (not a 'not run' record), else None."""
    data = read_result(name)
    measured = data is not None and "provenance" in data and not str(data.get("status", "")).startswith("not run")
    return data if measured else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--num-workers", default="auto", help="data.num_workers: a number or auto")
    parser.add_argument("--pipelines", nargs="+", choices=("cache", "pil"), default=["cache", "pil"],
                        help="input pipelines whose real rate is measured (the first is the headline)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the precision/format variants")
    parser.add_argument("--quick", action="store_true", help="5 steps")
    parser.add_argument("--output", default="gpu")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds = 5, 2, 1
    command = "python -m benchmarks gpu " + " ".join(sys.argv[2:] if argv is None else argv)
    info = machine_info(PACKAGES)
    if not torch.cuda.is_available():
        measured = _measured(args.output)
        if measured is not None:  # `make bench` on a CPU machine must not erase what a lent GPU measured
            print(f"not run: no GPU lent (CUDA not available); keeping benchmarks/results/{args.output}.json "
                  f"from {measured['provenance'].get('git_commit', '?')[:8]}")
            return measured
        result = {"benchmark": "training throughput on a GPU", "command": command.strip(), "machine": info,
                  "status": "not run: no GPU lent (CUDA not available)", "loadavg": os.getloadavg()}
        write_result(args.output, result)
        print(result["status"])
        return result
    from benchmarks.loader_bench import build_trainer

    torch.backends.cudnn.benchmark = True
    overrides = ["model.backbone=resnet50", "model.pretrained=none", "data.image_size=224",
                 "data.glyphs.image_size=224", f"data.num_workers={args.num_workers}", "train.device=cuda",
                 "train.amp=true", "train.channels_last=auto", f"train.batch_size={args.batch}"]
    pipelines = {"cache": ["data.cache=true", "data.augment_on=device"], "pil": ["data.cache=false"]}
    with tempfile.TemporaryDirectory(prefix="xbn_gpu_") as tmp:
        from xbn.utils.cache import CACHE_ENV as CACHE_DIR_ENV

        os.environ[CACHE_DIR_ENV] = str(Path(tmp) / "cache")
        trainers = {}
        for name in args.pipelines:
            trainers[name], params, _ = build_trainer(Path(tmp) / name, [*overrides, *pipelines[name]])
        trainer = trainers[args.pipelines[0]]
        first = next(iter(trainer.loader))
        images = trainer.augment_batch(first[0]) if isinstance(first[0], dict) else first[0].cuda()
        images, labels = images.cuda(), first[1].cuda()
        synthetic = _rate(trainer, _repeat((images, labels)), args.steps, args.warmup)
        reals: dict[str, list[float]] = {name: [] for name in trainers}
        for r in range(args.rounds):  # interleaved, the order alternating: GPU clock drift hits both alike
            for name in (list(trainers) if r % 2 == 0 else list(reversed(trainers))):
                # the batches as an epoch iterates them (the cache's batch stage prepared ahead on the GPU)
                reals[name].append(_rate(trainers[name], _cycle(trainers[name].epoch_batches()), args.steps,
                                         args.warmup))
        real_by_pipeline = {name: {"median_images_per_s": round(statistics.median(v), 1),
                                   "per_round": [round(x, 1) for x in v],
                                   "real_to_synthetic_ratio": round(statistics.median(v) / synthetic, 3),
                                   "num_workers": trainers[name].num_workers, **trainers[name].data_pipeline}
                            for name, v in reals.items()}
        real = statistics.median(reals[args.pipelines[0]])
        for name in args.pipelines[1:]:  # the rest only for their real rate: free their GPU memory
            del trainers[name]
        variants = _variants(trainer, (images, labels), args.steps, args.warmup, args.rounds)
        inference = _inference_variants(trainer.model, images, args.rounds)
        served_paths = _served_paths(trainer.model, trainer.data_config, images, args.rounds)
    result = {
        "benchmark": "training throughput on a GPU", "command": command.strip(),
        "machine": info | {"gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda},
        "status": "ok", "loadavg": os.getloadavg(),
        "settings": {"backbone": "resnet50", "image_size": 224, "batch": args.batch, "amp": "bfloat16",
                     "channels_last": trainer.channels_last, "num_workers": trainer.num_workers,
                     "pipeline": args.pipelines[0], "steps": args.steps,
                     "variant_rounds": args.rounds,
                     "memory": params.memory.method},
        "synthetic_images_per_s": round(synthetic, 1), "real_images_per_s": round(real, 1),
        "real_to_synthetic_ratio": round(real / synthetic, 3), "target_at_least": TARGET,
        "verdict": verdict(min(reals[args.pipelines[0]]) / synthetic, max(reals[args.pipelines[0]]) / synthetic,
                           at_least=TARGET),
        "real_by_pipeline": real_by_pipeline,
        "channels_last_auto": trainer.memory_format, "variants": variants, "inference": inference,
        "served": served_paths,
        "peak_gpu_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }
    write_result(args.output, result)
    print(f"synthetic {synthetic:.1f} img/s, real {real:.1f} img/s, ratio {real / synthetic:.3f} "
          f"({args.pipelines[0]}; target >= {TARGET}: {result['verdict']}); by pipeline {real_by_pipeline}; {variants}; "
          f"auto: {trainer.memory_format}; inference {inference}; served {served_paths}")
    return result


if __name__ == "__main__":
    from benchmarks.__main__ import main as cli

    sys.exit(cli(["gpu", *sys.argv[1:]]))
