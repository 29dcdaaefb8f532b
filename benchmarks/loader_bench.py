"""Data pipeline vs model: images/s the training loader delivers vs images/s a training step consumes (CPU).

    python -m benchmarks loader [--quick] [--rounds 3] [--batches-per-round 12] [--steps-per-round 4]
                                [--epoch-rounds 3]

Everything is the trainer's own: `xbn.training.trainer.Trainer` is built on the generated glyph default (in a
temporary folder) with params.yaml's defaults (ImageDataset + ClassBalancedBatchSampler + RankBatchSampler +
SeededSamples, data.num_workers = 2, 64 px, tf_efficientnet_lite0, batch 64, the memory criterion). Three
quantities, measured in alternating rounds so that other load on the machine hits them alike, medians reported:
  loader  images/s of `trainer.loader` alone, steady state (from its first batch on; worker start-up separate)
  model   images/s of the training step alone on one preloaded batch: forward, memory loss, backward, AdamW
          step, backbone trainable (the main phase, after the warm-up)
  train   images/s of the two together, as in `Trainer._train_epoch` (the loader's workers share the cores)
Target: loader >= 1.5 x model. The loader's workers and the step share the cores, so the ratio is read only
from a run whose 1-minute load average stayed below `LOAD_LIMIT` (the report drops it otherwise); on a busier
machine the benchmark does not start unless `--force`.

Then the decode cache (issue 44 item 1) against the PIL path, one training epoch each (`Trainer._train_epoch`:
the loader and the steps together, as `xbn train` runs them), in `--epoch-rounds` interleaved rounds that
alternate which goes first:
  pil    yesterday's input pipeline: `data.cache=false data.num_workers=2` (PIL decode + timm's transform;
         its workers now persist across epochs too, which only favours it)
  cache  params.yaml's defaults with `data.cache=true` (whatever `--set` says): the decode cache (built once
         before the rounds, its time reported apart), the batch stage of the augmentation in the workers'
         collate, `data.num_workers: auto` (unless `--set` gives a number)
Target: epoch wall time cache / pil <= 0.8, met when the interquartile range of the rounds' ratios is at or
below it (`benchmarks.verdicts`). The cache file goes to a temporary folder (XBN_CACHE_DIR), not the user's cache.
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

from benchmarks.common import machine_info, markdown_table, write_result
from benchmarks.verdicts import interval, verdict

PACKAGES = ("torch", "torchvision", "timm", "pillow", "numpy")
TARGET = 1.5
EPOCH_TARGET = 0.8  # epoch wall time, cache / pil
PIL_TODAY = ["data.cache=false", "data.num_workers=2"]  # the input pipeline before the decode cache
LOAD_LIMIT = 1.5  # 1-minute load average: above it other work, not the pipeline, sets the ratio


def recorded_loads(result: dict[str, Any]) -> list[float]:
    """Every 1-minute load average the result recorded: before each round, and the run's before and after."""
    loads = [r["loadavg_before"][0] for r in result.get("rounds", [])]
    if p := result.get("provenance"):
        loads += [p["loadavg_1min_before"], p["loadavg_1min_after"]]
    return [round(x, 2) for x in loads]


def build_trainer(work: Path, overrides: list[str]):
    from xbn.config import load_params
    from xbn.stages.prepare import prepare
    from xbn.training.trainer import Trainer

    defaults = Path(__file__).resolve().parent.parent / "params.yaml"
    params = load_params(defaults, [
        f"data.root={work / 'glyphs'}", f"data.manifest={work / 'manifest.csv'}", "train.device=cpu",
        f"train.checkpoint_dir={work / 'models'}", f"train.metrics_dir={work / 'metrics'}",
        "tracking.enabled=false", *overrides])
    start = time.perf_counter()
    prepare(params)  # generates the glyph set (the `xbn generate` data) and writes the manifest
    generate_s = time.perf_counter() - start
    trainer = Trainer(params, progress=False)
    # The main phase: backbone trainable, AdamW (the warm-up trains the head only, which is cheaper).
    trainer.optimizer, trainer.scheduler = trainer._optimizer_for(params.train.warmup_epochs)
    trainer.net.train()
    return trainer, params, generate_s


def time_loader(trainer, batches: int, epoch: int) -> dict[str, float]:
    trainer.sampler.set_epoch(epoch)
    trainer.loader_generator.manual_seed(epoch)
    start = time.perf_counter()
    it = iter(trainer.loader)
    images, _, _ = next(it)
    first = time.perf_counter()
    n = 0
    for images, _, _ in it:
        n += len(images)
        if n >= batches * len(images):
            break
    end = time.perf_counter()
    del it  # shuts the workers down
    if n == 0:
        raise RuntimeError("the loader has a single batch per epoch: use a larger data set or a smaller batch")
    return {"startup_s": first - start, "images_per_s": n / (end - first)}


def time_model(trainer, images: torch.Tensor, labels: torch.Tensor, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step(images, labels)
    return steps * len(images) / (time.perf_counter() - start)


def time_train(trainer, steps: int, epoch: int) -> float:
    trainer.sampler.set_epoch(epoch)
    it = iter(trainer.loader)
    images, labels, _ = next(it)  # worker start-up is not a per-step cost
    trainer.step(images, labels)
    start = time.perf_counter()
    n = 0
    for i, (images, labels, _) in enumerate(it):
        trainer.step(images, labels)
        n += len(images)
        if i + 1 >= steps:
            break
    rate = n / (time.perf_counter() - start)
    del it
    return rate


def time_epochs(work: Path, overrides: list[str], rounds: int) -> dict[str, Any]:
    """One training epoch of the PIL path and of the cached path per round, alternating which goes first; the
    rounds' seconds, each round's ratio cache / pil, and their interval and verdict against `EPOCH_TARGET`."""
    from xbn.utils.cache import CACHE_ENV as CACHE_DIR_ENV

    os.environ[CACHE_DIR_ENV] = str(work / "cache")
    trainers, settings = {}, {}
    for name, extra in (("pil", PIL_TODAY), ("cache", ["data.cache=true"])):
        start = time.perf_counter()
        trainer, params, _ = build_trainer(work / name, [*overrides, *extra])
        trainers[name] = trainer
        settings[name] = {"data.cache": params.data.cache, "data.num_workers": params.data.num_workers,
                          "resolved_workers": trainer.num_workers, **trainer.data_pipeline,
                          "setup_s": round(time.perf_counter() - start, 1)}
        for i, (images, labels, _) in enumerate(trainer.epoch_batches()):  # warm-up: workers (they persist),
            trainer.step(images, labels)  # allocator, optimizer state
            if i == 1:
                break
    rows = []
    for r in range(rounds):
        order = ["pil", "cache"] if r % 2 == 0 else ["cache", "pil"]
        row: dict[str, Any] = {"order": order, "loadavg_before": [round(v, 2) for v in os.getloadavg()]}
        for name in order:
            trainer = trainers[name]
            trainer.epoch = r + 1  # another epoch's batches and augmentation, the same for both
            start = time.perf_counter()
            trainer._train_epoch()
            row[f"{name}_s"] = round(time.perf_counter() - start, 3)
        row["ratio"] = round(row["cache_s"] / row["pil_s"], 4)
        rows.append(row)
        print(f"epoch round {r}: pil {row['pil_s']:.1f} s, cache {row['cache_s']:.1f} s, ratio {row['ratio']:.3f} "
              f"(load {row['loadavg_before'][0]})", flush=True)
    spread = interval(r["ratio"] for r in rows)
    images = len(trainers["pil"].train_paths)
    return {"settings": settings, "train_images": images, "rounds": rows,
            "seconds": {name: interval(r[f"{name}_s"] for r in rows) for name in trainers},
            "cache_over_pil": spread, "target_at_most": EPOCH_TARGET,
            "verdict": verdict(spread["p25"], spread["p75"], at_most=EPOCH_TARGET)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches-per-round", type=int, default=12)
    parser.add_argument("--steps-per-round", type=int, default=4)
    parser.add_argument("--epoch-rounds", type=int, default=3, help="interleaved epochs of the PIL and cached paths")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="params override key=value")
    parser.add_argument("--quick", action="store_true", help="small glyph set, one short round")
    parser.add_argument("--output", default="loader")
    parser.add_argument("--force", action="store_true", help=f"measure even at a load average >= {LOAD_LIMIT}")
    args = parser.parse_args(argv)
    if (load := os.getloadavg()[0]) >= LOAD_LIMIT and not args.force:
        print(f"loader: not measured, the 1-minute load average is {load:.2f} >= {LOAD_LIMIT} (the ratio would "
              "measure contention); the previous result is kept. --force measures anyway.")
        return {}
    if args.quick:
        args.rounds, args.batches_per_round, args.steps_per_round, args.epoch_rounds = 1, 3, 2, 1
        # enough batches for a round: ~50 training classes x 6 images in batches of 32
        args.overrides = ["data.glyphs.classes=120", "train.batch_size=32", *args.overrides]
        args.output = "loader_quick" if args.output == "loader" else args.output
    command = "python -m benchmarks loader " + " ".join(sys.argv[2:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="xbn_loader_") as tmp:
        trainer, params, generate_s = build_trainer(Path(tmp), args.overrides)
        images, labels, _ = next(iter(trainer.loader))
        trainer.step(images, labels)  # warm-up: allocator, optimizer state
        rounds = []
        for r in range(args.rounds):
            load = os.getloadavg()
            loader = time_loader(trainer, args.batches_per_round, epoch=r)
            model = time_model(trainer, images, labels, args.steps_per_round)
            both = time_train(trainer, args.steps_per_round, epoch=100 + r)
            rounds.append({"loadavg_before": load, "loader_images_per_s": loader["images_per_s"],
                           "loader_startup_s": loader["startup_s"], "model_images_per_s": model,
                           "train_images_per_s": both})
            print(f"round {r}: loader {loader['images_per_s']:.1f} img/s, model {model:.1f} img/s, "
                  f"together {both:.1f} img/s (load {load[0]:.1f})", flush=True)
        epochs = time_epochs(Path(tmp) / "epochs", args.overrides, args.epoch_rounds) if args.epoch_rounds else None
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k != "loadavg_before"}
    ratios = [r["loader_images_per_s"] / r["model_images_per_s"] for r in rounds]
    ratio = statistics.median(ratios)
    summary = {
        **{f"median_{k}": round(v, 3) for k, v in med.items()},
        "loader_to_model_ratio": round(ratio, 3), "per_round_ratios": [round(x, 3) for x in ratios],
        "train_to_model_ratio": round(med["train_images_per_s"] / med["model_images_per_s"], 3),
        "target": f"loader >= {TARGET} x model", "target_met": ratio >= TARGET,
    }
    info = machine_info(PACKAGES) | {"threads": torch.get_num_threads()}
    result = {
        "benchmark": "training loader vs training step, images/s, CPU",
        "command": command.strip(), "machine": info,
        "settings": {"dataset": "glyphs", "glyph_classes": params.data.glyphs.classes,
                     "image_size": params.data.image_size, "num_workers": trainer.num_workers,
                     "data_cache": params.data.cache,
                     "batch_size": params.train.batch_size, "backbone": params.model.backbone,
                     "memory": params.memory.method, "memory_rows": trainer.criterion.memory.memory_size
                     if trainer.criterion.memory is not None else 0,
                     "rounds": args.rounds, "batches_per_round": args.batches_per_round,
                     "steps_per_round": args.steps_per_round, "generate_and_prepare_s": round(generate_s, 1)},
        "rounds": rounds, "summary": summary,
        **({"epochs": epochs} if epochs else {}),
    }
    path = write_result(args.output, result)
    print(markdown_table(list(summary), [list(summary.values())]))
    if epochs:
        e = epochs["cache_over_pil"]
        print(f"epoch wall time cache / pil: median {e['median']} (IQR {e['p25']}-{e['p75']}, {e['n']} rounds), "
              f"target <= {EPOCH_TARGET}: {epochs['verdict']}")
    print(f"wrote {path}")
    return result


def render(result: dict[str, Any]) -> str:
    s = result["summary"]
    rows = [["loader (alone)", s["median_loader_images_per_s"]], ["training step (alone)", s["median_model_images_per_s"]],
            ["both, as in the epoch loop", s["median_train_images_per_s"]]]
    return markdown_table(["what", "images/s (median)"], rows)


def render_epochs(epochs: dict[str, Any]) -> str:
    """The PIL-vs-cache epoch table and its target line."""
    pil, cache = epochs["settings"]["pil"], epochs["settings"]["cache"]
    rows = [[f"{name} (data.cache={cfg['data.cache']}, {cfg['resolved_workers']} workers)",
             epochs["seconds"][name]["median"], epochs["seconds"][name]["p25"], epochs["seconds"][name]["p75"]]
            for name, cfg in (("pil", pil), ("cache", cache))]
    ratio = epochs["cache_over_pil"]
    built = (cache.get("cache") or {}).get("built_s")
    head = (f"One training epoch ({epochs['train_images']} images), the PIL path against the decode cache, "
            f"{ratio['n']} interleaved round(s):")
    return "\n".join([
        head, "",
        markdown_table(["pipeline", "epoch s (median)", "p25", "p75"], rows), "",
        f"cache / pil: median {ratio['median']} (IQR {ratio['p25']}-{ratio['p75']}; target <= "
        f"{epochs['target_at_most']}) -> {epochs['verdict']}" + (f"; the cache was built once in {built} s." if built
                                                                 is not None else "."), ""])


if __name__ == "__main__":
    from benchmarks.__main__ import main as cli

    sys.exit(cli(["loader", *sys.argv[1:]]))
