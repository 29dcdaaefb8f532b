"""Accuracy on real data: Omniglot, class-disjoint, every memory method at batch 16 and 64.

    python -m benchmarks omniglot [--quick] [--seeds 0 1 2] [--epochs 2] [--train-classes 700] ...

Omniglot's background set (964 characters x 20 drawings, 105 x 105, `../shared/data/omniglot/
images_background.npz`, not part of the project) is exported once to PNG files plus a `path,label,split`
label file (the project's `csv` dataset format) in a cache folder outside the repository
(`~/.cache/xbn-bench/omniglot`, or `$XBN_BENCH_CACHE`). The characters are split class-disjointly with a fixed
seed: 700 training characters (of which `data.val_classes` are carved out for model selection by the project's
own `carve_validation`) and 264 test characters. Each run trains the default embedder through xbn's own API
(`xbn.training.trainer.train`, then `xbn.stages.evaluate.evaluate` on the test split, leave-one-out) with the
memory as large as the training set (`memory.size=1.0`). Methods: none, xbm, xbm* (`memory.add_batch_loss`),
xbn, axbn, ema. The grid is (method x batch x seed); results are written after every run, so an interrupted
grid keeps what it finished. Skips with a message when the npz is not there.
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

import numpy as np

from benchmarks.common import machine_info, markdown_table, write_result

REPO = Path(__file__).resolve().parent.parent
NPZ = REPO.parent / "shared" / "data" / "omniglot" / "images_background.npz"
CACHE = Path(os.environ.get("XBN_BENCH_CACHE", Path.home() / ".cache" / "xbn-bench")) / "omniglot"
DOCS = REPO / "docs"
# name -> params overrides
METHODS: dict[str, list[str]] = {
    "none": ["memory.method=none"],
    "xbm": ["memory.method=xbm"],
    "xbm*": ["memory.method=xbm", "memory.add_batch_loss=true"],
    "xbn": ["memory.method=xbn"],
    "axbn": ["memory.method=axbn"],
    "ema": ["memory.method=ema"],
}
SPLIT_SEED = 0
TRAIN_CLASSES, TEST_CLASSES = 700, 264
PACKAGES = ("torch", "timm", "pytorch-metric-learning", "faiss-cpu", "numpy")


def export(npz: Path = NPZ, out: Path = CACHE) -> Path:
    """Write every drawing as `images/<class>/<i>.png` (grayscale, ink black) once; returns the folder."""
    done = out / ".exported"
    if done.exists():
        return out
    from PIL import Image

    data = np.load(npz)
    images = data["images"]  # (964, 20, 105, 105) bool, True = white background
    for c in range(images.shape[0]):
        folder = out / "images" / f"c{c:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(images.shape[1]):
            Image.fromarray(images[c, i].astype(np.uint8) * 255, mode="L").save(folder / f"{i:02d}.png")
    done.write_text(f"{images.shape}\n")
    return out


def class_split(num_classes: int = 964, seed: int = SPLIT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """(700 training classes, 264 test classes), disjoint, from a fixed permutation."""
    order = np.random.default_rng(seed).permutation(num_classes)
    return np.sort(order[:TRAIN_CLASSES]), np.sort(order[TRAIN_CLASSES:TRAIN_CLASSES + TEST_CLASSES])


def write_labels(root: Path, path: Path, train_classes: int, test_classes: int, per_class: int) -> dict[str, int]:
    """A `path,label,split` file over the first `train_classes` / `test_classes` of the fixed split."""
    train, test = class_split()
    rows = ["path,label,split"]
    for split, classes in (("train", train[:train_classes]), ("test", test[:test_classes])):
        for c in classes:
            rows += [f"images/c{c:03d}/{i:02d}.png,c{c:03d},{split}" for i in range(per_class)]
    path.write_text("\n".join(rows) + "\n")
    return {"train_classes": int(min(train_classes, len(train))), "test_classes": int(min(test_classes, len(test)))}


def prepare_manifest(root: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from xbn.data import carve_validation, read_dataset, write_manifest

    labels = work / "labels.csv"
    info = write_labels(root, labels, args.train_classes, args.test_classes, args.images_per_class)
    frame = carve_validation(read_dataset("csv", root, labels_file=labels), args.val_classes, seed=SPLIT_SEED)
    write_manifest(frame, work / "manifest.csv")
    info["images"] = {s: int((frame["split"] == s).sum()) for s in ("train", "val", "test")}
    return info


def overrides(root: Path, run_dir: Path, manifest: Path, method: str, batch: int, seed: int,
              args: argparse.Namespace) -> list[str]:
    return [
        "data.dataset=csv", f"data.root={root}", f"data.labels_file={manifest.parent / 'labels.csv'}",
        f"data.manifest={manifest}", f"data.image_size={args.image_size}", f"data.num_workers={args.num_workers}",
        f"data.val_classes={args.val_classes}", f"data.split_seed={SPLIT_SEED}",
        *METHODS[method], "memory.size=1.0",
        f"train.batch_size={batch}", f"train.epochs={args.epochs}", f"train.warmup_epochs={args.warmup_epochs}",
        f"train.seed={seed}", "train.device=cpu", f"train.checkpoint_dir={run_dir / 'models'}",
        f"train.metrics_dir={run_dir / 'metrics'}", "train.log_every=50",
        "eval.baseline=false", f"eval.output={run_dir / 'metrics' / 'eval.json'}", "eval.k=[1,2,4,8]",
        "tracking.enabled=false",
    ]


def run_one(root: Path, work: Path, method: str, batch: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    from xbn.config import load_params
    from xbn.stages.evaluate import evaluate
    from xbn.training.trainer import train

    run_dir = work / f"{method.replace('*', 'star')}_b{batch}_s{seed}"
    params = load_params(None, overrides(root, run_dir, work / "manifest.csv", method, batch, seed, args))
    load = os.getloadavg()
    start = time.perf_counter()
    summary = train(params, progress=False)
    train_s = time.perf_counter() - start
    start = time.perf_counter()
    metrics = evaluate(params)
    return {
        "method": method, "batch": batch, "seed": seed, "train_s": round(train_s, 1),
        "eval_s": round(time.perf_counter() - start, 1), "loadavg_before": load, "loadavg_after": os.getloadavg(),
        "recall@1": metrics["recall@1"], "map@r": metrics["map@r"], "nmi": metrics.get("nmi"),
        "recall@4": metrics.get("recall@4"), "best_epoch": summary["best_epoch"],
        "best_val_recall@1": summary["best_val_recall@1"], "memory_rows": summary["memory_rows"],
        "iterations": summary["iterations"],
    }


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    table = []
    for method in METHODS:
        for batch in sorted({r["batch"] for r in runs}):
            sel = [r for r in runs if r["method"] == method and r["batch"] == batch and "recall@1" in r]
            if not sel:
                continue
            row: dict[str, Any] = {"method": method, "batch": batch, "seeds": len(sel)}
            for key in ("recall@1", "map@r"):
                values = [r[key] for r in sel]
                row[key] = statistics.mean(values)
                row[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
            row["train_s"] = statistics.mean(r["train_s"] for r in sel)
            table.append(row)
    return table


def render(result: dict[str, Any]) -> str:
    def cell(r: dict[str, Any], key: str) -> str:
        return f"{r[key]:.4f} ± {r[key + '_std']:.4f}" if r["seeds"] > 1 else f"{r[key]:.4f}"

    rows = [[r["method"], r["batch"], r["seeds"], cell(r, "recall@1"), cell(r, "map@r"), round(r["train_s"])]
            for r in result["table"]]
    return markdown_table(["method", "batch", "seeds", "R@1 (mean ± std)", "MAP@R (mean ± std)", "train s"], rows)


def plot(result: dict[str, Any], path: Path) -> Path | None:
    if not result["table"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in METHODS:
        sel = sorted((r for r in result["table"] if r["method"] == method), key=lambda r: r["batch"])
        if sel:
            ax.errorbar([r["batch"] for r in sel], [r["recall@1"] for r in sel],
                        yerr=[r["recall@1_std"] for r in sel], marker="o", capsize=3, label=method)
    ax.set_xscale("log", base=2)
    batches = sorted({r["batch"] for r in result["table"]})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size")
    ax.set_ylabel("test Recall@1")
    s = result["settings"]
    ax.set_title(f"Omniglot, {s['train_classes']} train / {s['test_classes']} test classes, "
                 f"{s['image_size']} px, {s['warmup_epochs']} warm-up + {s['epochs']} epochs, mean ± std over seeds", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--train-classes", type=int, default=TRAIN_CLASSES, help="of the 700 (val carved from them)")
    parser.add_argument("--test-classes", type=int, default=TEST_CLASSES, help="of the 264")
    parser.add_argument("--images-per-class", type=int, default=20)
    parser.add_argument("--val-classes", type=float, default=0.15)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--warmup-epochs", type=int, default=2)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default torch's); 1 wastes less on an oversubscribed machine")
    parser.add_argument("--output", default="omniglot")
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from the results file")


QUICK = {"methods": ["none", "xbm"], "batches": [16], "seeds": [0], "train_classes": 40, "test_classes": 20,
         "epochs": 1, "warmup_epochs": 0, "image_size": 32, "output": "omniglot_quick"}


def main(args: argparse.Namespace) -> int:
    from benchmarks.common import RESULTS_DIR

    if args.plot_only:
        import json

        result = json.loads((RESULTS_DIR / f"{args.output}.json").read_text())
        print(plot(result, DOCS / f"{args.output}_recall.png"))
        return 0
    if not NPZ.exists():
        print(f"omniglot: skipped, {NPZ} not found (the data is not part of the project)")
        return 0
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    root = export()
    command = "python -m benchmarks omniglot " + " ".join(sys.argv[2:])
    result: dict[str, Any] = {
        "benchmark": "Omniglot retrieval accuracy per memory method and batch size",
        "command": command.strip(), "machine": machine_info(PACKAGES), "cache": str(root),
        "settings": {k: getattr(args, k) for k in ("methods", "batches", "seeds", "train_classes", "test_classes",
                                                   "images_per_class", "val_classes", "image_size", "epochs",
                                                   "warmup_epochs", "num_workers", "threads")},
        "runs": [], "table": [],
    }
    result["settings"]["backbone"] = "tf_efficientnet_lite0 (offline ImageNet weights), memory.size=1.0"
    grid = [(m, b, s) for s in args.seeds for b in args.batches for m in args.methods]  # seed-major: 1 seed first
    with tempfile.TemporaryDirectory(prefix="xbn_omniglot_") as tmp:
        work = Path(tmp)
        result["split"] = prepare_manifest(root, work, args)
        print(f"omniglot: {result['split']}, {len(grid)} runs", flush=True)
        started = time.perf_counter()
        for i, (method, batch, seed) in enumerate(grid, 1):
            try:
                run = run_one(root, work, method, batch, seed, args)
            except Exception as exc:  # one failed configuration must not lose the others
                run = {"method": method, "batch": batch, "seed": seed, "error": f"{type(exc).__name__}: {exc}"}
            result["runs"].append(run)
            result["table"] = aggregate(result["runs"])
            result["elapsed_s"] = round(time.perf_counter() - started, 1)
            write_result(args.output, result)
            shown = {k: run.get(k) for k in ("recall@1", "map@r", "train_s", "eval_s", "error") if k in run}
            print(f"[{i}/{len(grid)}] {method} B={batch} seed={seed}: {shown}", flush=True)
    result["table_md"] = render(result)
    result["plot"] = str(plot(result, DOCS / f"{args.output}_recall.png"))
    write_result(args.output, result)
    print(result["table_md"])
    return 0
