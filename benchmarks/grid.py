"""Evidence over seeds: every memory method at several batch sizes, 3 seeds each, on the glyph default and on
Omniglot (seed 000's Table 2 / Figure 1 form), within a CPU budget.

    python -m benchmarks grid [--datasets glyphs omniglot] [--batches 16 64] [--seeds 0 1 2] [--workers 2]
    python -m benchmarks grid --quick          (2 methods, 1 seed, 1 epoch: checks the machinery)
    python -m benchmarks grid --datasets omniglot64 glyphs64 --methods none xbm xbn axbn --batches 16 32 64 \
        --output grid_scale [--resume]         (issue 30: a user's scale, many classes against a small batch)
    python -m benchmarks grid --regime roth|memvir|mpn|refine [--quick]   (a seed method in its paper's regime:
                                                                 benchmarks/regimes.py)

Each run trains through xbn's own API (`xbn.training.fit`, the shipped defaults of params.yaml plus the
method's and the scale's overrides below, so `memory.start`, the lr step and AXBN's values are the shipped
ones) and evaluates the selected model on the test split (`xbn.stages.evaluate.evaluate`, leave-one-out). The
validation R@1 of the selected epoch is recorded too: the shipped default method is chosen on it, never on test.

Scale (chosen to fit the whole grid in about 90 minutes on the 2-core CPU machine; see `DATASETS`): 32 px
images, 1 head warm-up + 8 epochs, the lr stepped every 3 epochs (seed 000's 15 of 50, scaled), memory = the
training set, so the memory turns over once an epoch, 8 times a run. Omniglot is read from
`../shared/data/omniglot` (not part of the project; skipped with a message when absent) and exported once to
PNG files in a cache folder. Runs go to `--workers` processes with `--threads` torch threads each; the results
file is rewritten after every run, so an interrupted grid keeps what finished, and `--resume` skips the runs it
already holds.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, machine_info, markdown_table, write_result
from benchmarks.regimes import REGIMES

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
CACHE = Path(os.environ.get("XBN_BENCH_CACHE", Path.home() / ".cache" / "xbn-bench"))
PACKAGES = ("torch", "timm", "pytorch-metric-learning", "faiss-cpu", "numpy")

# name -> params overrides (everything else is params.yaml's shipped default).
METHODS: dict[str, list[str]] = {
    "none": ["memory.method=none"],
    # XBM as measured before `memory.center_gradient: auto` centred it (issue 52): the name keeps its results'
    # meaning.
    "xbm": ["memory.method=xbm", "memory.center_gradient=false"],
    "xbm*": ["memory.method=xbm", "memory.add_batch_loss=true", "memory.center_gradient=false"],
    # What params.yaml ships since issue 52: XBM with the minibatch loss, its memory loss's gradient centred.
    "xbm*_c": ["memory.method=xbm", "memory.add_batch_loss=true", "memory.center_gradient=true"],
    "xbn": ["memory.method=xbn"],
    "axbn": ["memory.method=axbn"],  # seed 000's p0 = 1, q = 1, r = 0.01, N = 100 (the shipped values)
    # Issue 45: the drift-corrected memories with the minibatch loss added, as the official XBM code always does
    # (PML's memory detaches its own rows, so a fresh in-batch pair gets gradient through its query side only).
    "xbn*": ["memory.method=xbn", "memory.add_batch_loss=true"],
    "axbn*": ["memory.method=axbn", "memory.add_batch_loss=true"],
    "ema": ["memory.method=ema"],  # m = 0.1, the paper's convention and best value (shipped)
    "axbn_auto": ["memory.method=axbn_auto"],
    # The memory size `xbn tune` preferred on the glyphs' validation split (docs/tuning.md: about 0.07).
    "xbn_small": ["memory.method=xbn", "memory.size=0.1"],
}
GRID_METHODS = ("none", "xbm", "xbm*", "xbn", "axbn", "ema", "axbn_auto")  # the grid
# The memory methods the shipped default is chosen from (issue 13: on validation R@1, mean over seeds).
DEFAULT_CANDIDATES = ("xbn", "axbn", "axbn_auto")

# Per dataset: the classes and images kept, and the image size. Glyphs: the embedded generator at 32 px,
# 240 classes (120 train, of which 18 carved out for validation, 120 test), 6 images each. Omniglot: 120 of the
# 700 training characters (18 for validation) and 100 of the 264 test characters, 10 drawings each.
# `default` is what `make run` trains: params.yaml's own glyph set and schedule, nothing scaled down (the
# shipped-defaults claim: `--datasets default --methods none <default method> --batches 64 --output promise`).
DATASETS: dict[str, dict[str, int]] = {
    "default": {},
    "glyphs": {"classes": 240, "images_per_class": 6, "image_size": 32},
    "omniglot": {"train_classes": 120, "test_classes": 100, "images_per_class": 10, "image_size": 32},
    # Issue 30, a user's scale: many classes against a small batch. Omniglot at 64 px, 360 of the 700 training
    # characters (306 train + 54 val), all 264 test characters, all 20 drawings; the glyphs at the shipped
    # 600 classes x 6 at 64 px for comparison. Both with the shipped lr step and 1 warm-up + 4 epochs, the
    # protocol the issue measured (`--datasets omniglot64 glyphs64 --batches 16 32 64 --output grid_scale`).
    "omniglot64": {"train_classes": 360, "test_classes": 264, "images_per_class": 20, "image_size": 64,
                   "warmup_epochs": 1, "epochs": 4, "lr_step_epochs": 4},
    "glyphs64": {"classes": 600, "images_per_class": 6, "image_size": 64,
                 "warmup_epochs": 1, "epochs": 4, "lr_step_epochs": 4},
    # Issue 42, SOP's regime: all 964 characters, 5 drawings each (chosen by a fixed seed), class-disjoint halves
    # for train (about 410 classes after validation) and test (482), 64 px; the grid's short schedule...
    "sop_like": {"sop_like": 1, "images_per_class": 5, "image_size": 64,
                 "warmup_epochs": 1, "epochs": 4, "lr_step_epochs": 4},
    # ...and the long one (seed 000's Table 2 setting, scaled): at batch 64 an epoch is about 32 steps, so the
    # memory joining 1,000 steps after the warm-up (epoch 32) and a 50% memory (16 steps a turn) turn over 30
    # times in the last 15 epochs; the lr steps x0.33 every 15 epochs (the paper's 15 of 50).
    "sop_like_long": {"sop_like": 1, "images_per_class": 5, "image_size": 64,
                      "warmup_epochs": 1, "epochs": 48, "lr_step_epochs": 15},
}
SCALE = {"warmup_epochs": 1, "epochs": 8, "lr_step_epochs": 3, "val_classes": 0.15}
SCALE_METHODS = ("none", "xbm", "xbn", "axbn")  # issue 30's grid
# A batch whose distinct images have a mean pairwise cosine at least this has collapsed (issue 52: every image
# within the miner's 0.2 positive margin of every other is a cosine above 0.98).
COLLAPSED_COSINE = 0.95
DEFAULT_BATCH = 64  # params.yaml's train.batch_size: the batch the shipped default must not lose to none at


def scale_of(dataset: str) -> dict[str, Any]:
    """The schedule a dataset runs: SCALE, less what its DATASETS entry sets itself."""
    return {**SCALE, **{k: v for k, v in DATASETS[dataset].items() if k in SCALE}}

QUICK = {"methods": ["none", "xbn"], "batches": [16], "seeds": [0], "datasets": ["glyphs"], "output": "grid_quick"}


def prepare(dataset: str, work: Path) -> tuple[list[str], dict[str, Any]]:
    """The dataset's files and manifest under `work`; returns the data overrides and a description."""
    from xbn.data import carve_validation, read_dataset, write_manifest

    spec = DATASETS[dataset]
    manifest = work / dataset / "manifest.csv"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    if dataset == "default":
        from xbn.config import load_params
        from xbn.data.glyphs import generate_glyphs

        d = load_params(REPO / "params.yaml").data
        g = d.glyphs
        spec = {**g.model_dump(), "image_size": d.image_size}
        root = generate_glyphs(CACHE / f"glyphs-{g.classes}-{g.images_per_class}-{g.image_size}-{g.seed}",
                               classes=g.classes, images_per_class=g.images_per_class, image_size=g.image_size,
                               seed=g.seed)
        frame = carve_validation(read_dataset("glyphs", root), d.val_classes, seed=d.split_seed)
        write_manifest(frame, manifest)
        return [f"data.root={root}", f"data.manifest={manifest}"], {"spec": spec, "splits": _counts(frame)}
    if dataset.startswith("glyphs"):
        from xbn.data.glyphs import generate_glyphs

        root = generate_glyphs(CACHE / f"glyphs-{spec['classes']}-{spec['images_per_class']}-{spec['image_size']}",
                               classes=spec["classes"], images_per_class=spec["images_per_class"],
                               image_size=spec["image_size"], seed=0)
        frame = read_dataset("glyphs", root)
        data = ["data.dataset=glyphs", f"data.root={root}"]
    else:
        from benchmarks.omniglot import NPZ, export, write_labels, write_sop_like_labels

        if not NPZ.exists():
            raise FileNotFoundError(f"{NPZ} not found (the data is not part of the project)")
        root = export()
        labels = manifest.parent / "labels.csv"
        if spec.get("sop_like"):
            write_sop_like_labels(root, labels, spec["images_per_class"])
        else:
            write_labels(root, labels, spec["train_classes"], spec["test_classes"], spec["images_per_class"])
        frame = read_dataset("csv", root, labels_file=labels)
        data = ["data.dataset=csv", f"data.root={root}", f"data.labels_file={labels}"]
    scale = scale_of(dataset)
    frame = carve_validation(frame, scale["val_classes"], seed=0)
    write_manifest(frame, manifest)
    data += [f"data.manifest={manifest}", f"data.image_size={spec['image_size']}",
             f"data.val_classes={scale['val_classes']}", "validate.check_published_counts=false",
             f"train.epochs={scale['epochs']}", f"train.warmup_epochs={scale['warmup_epochs']}",
             f"train.lr_step_epochs={scale['lr_step_epochs']}"]
    return data, {"spec": spec, "splits": _counts(frame)}


def _counts(frame) -> dict[str, dict[str, int]]:
    return {s: {"images": int((frame["split"] == s).sum()), "classes": int(frame[frame["split"] == s]["label"]
                                                                           .nunique())}
            for s in ("train", "val", "test")}


def run_overrides(data: list[str], method: list[str], batch: int, seed: int, run_dir: Path,
                  device: str = "cpu") -> list[str]:
    """The run's overrides: the data and scale, the run's own, then the method's (`method`: a regime may turn
    the embedding-space metrics back on)."""
    return [
        *data, "memory.size=1.0",
        f"train.batch_size={batch}", f"train.seed={seed}", f"train.device={device}",
        f"train.checkpoint_dir={run_dir / 'models'}", f"train.metrics_dir={run_dir / 'metrics'}",
        "train.log_every=1000", "data.num_workers=0",
        "eval.baseline=false", "eval.embedding_space=false", f"eval.output={run_dir / 'metrics' / 'eval.json'}",
        "eval.k=[1,2,4,8]", "tracking.enabled=false", f"refine.output={run_dir / 'models' / 'refiner.pt'}",
        f"refine.metrics={run_dir / 'metrics' / 'refine.json'}", *method,
    ]


def exit_with_parent(parent: int, every_s: float = 1.0) -> None:
    """A pool worker's initializer: exit once the grid's process is gone. A grid stopped with `kill` (or
    killed) otherwise leaves its workers training to the end of their runs, beside whatever is measured next."""
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def run_one(overrides: list[str], threads: int, params_file: Path) -> dict[str, Any]:
    """One training + test evaluation in this (worker) process, from the grid's snapshot of params.yaml."""
    import torch

    from xbn.config import load_params
    from xbn.stages.evaluate import evaluate
    from xbn.training import fit
    from xbn.utils.allocator import fix_malloc_thresholds

    torch.set_num_threads(threads)
    fix_malloc_thresholds()  # as `xbn train` does (xbn.cli.main)
    params = load_params(params_file, overrides)
    load = os.getloadavg()
    started = time.perf_counter()
    summary = fit(params, progress=False)
    train_s = time.perf_counter() - started
    variants: dict[str, dict[str, Any]] = {}
    extra: dict[str, Any] = {}
    if params.refine.enabled:  # seed 001: the refiner on this run's backbone; the run's row is the refined one
        from xbn.stages.refine import refine

        refined = refine(params)
        metrics = evaluate(params)
        variants["plain"] = {"recall@1": metrics["recall@1"], "map@r": metrics["map@r"],
                             "val_recall@1": refined["val_plain_recall@1"]}
        summary["best_val_recall@1"] = refined["val_refined_recall@1"]
        metrics = {**metrics, **metrics.pop("refined")}
        extra = {"refine_epoch": refined["epoch"], "refine_served": refined["served"],
                 "refine_train_views_recall@1": refined["train_plain_recall@1"]}
    else:
        metrics = evaluate(params)
    extra.update(_drift_record(Path(params.train.metrics_dir), summary))
    if "mpn" in metrics:  # Intra-Batch at test time, over the expanded k-reciprocal neighbourhoods
        variants["mpn_test_time"] = {k: metrics["mpn"][k] for k in ("recall@1", "map@r")}
    return {"recall@1": metrics["recall@1"], "map@r": metrics["map@r"], "recall@4": metrics.get("recall@4"),
            "rho_spectrum": metrics.get("rho_spectrum"),
            "nmi": metrics.get("nmi"), "val_recall@1": summary["best_val_recall@1"],
            "untrained_val_recall@1": summary["untrained_val_recall@1"], "best_epoch": summary["best_epoch"],
            "iterations": summary["iterations"], "memory_rows": summary["memory_rows"], **extra,
            "train_s": round(train_s, 1), "loadavg_before": load[0], "loadavg_after": os.getloadavg()[0],
            **({"gpu": torch.cuda.get_device_name()} if params.train.device.startswith("cuda") else {}),
            **({"variants": variants} if variants else {})}


def plan(keys: list[dict[str, Any]], workers: int, cpu: str, device: str) -> dict[str, Any]:
    """The grid's cost before it starts (issue 42: estimate first, write the plan with its hours in the results
    file): each run's training time is the median `train_s` of earlier runs of the same dataset, batch and
    method on this machine kind in any results file, else of the dataset and batch, else unknown; the
    total assumes `workers` runs at once."""
    import json

    earlier = []
    for path in RESULTS_DIR.glob("grid*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        earlier += [r for r in data.get("runs", []) if "train_s" in r and r.get("cpu") == cpu
                    and bool(r.get("gpu")) == device.startswith("cuda")]

    def median(sel: list[dict[str, Any]]) -> float | None:
        return statistics.median(r["train_s"] for r in sel) if sel else None

    seconds, unknown = [], 0
    for k in keys:
        same = [r for r in earlier if (r["dataset"], r["batch"]) == (k["dataset"], k["batch"])]
        s = median([r for r in same if r["method"] == k["method"]]) or median(same)
        if s is None:
            unknown += 1
        else:
            seconds.append(s)
    total = sum(seconds) + unknown * statistics.mean(seconds) if seconds else None
    return {"runs": len(keys), "workers": workers, "unknown_runs": unknown,
            "estimated_hours": None if total is None else round(total / max(1, workers) / 3600, 2),
            "basis": f"median train time of earlier runs on {cpu}{' with a GPU' if device.startswith('cuda') else ''}"
                     f" ({len(keys) - unknown} of {len(keys)} runs estimated; evaluation not counted)"}


def _drift_record(metrics_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """Issue 42's traces of a run: val R@1 per epoch (a collapse shows as a dip), and where the run measured
    the memory's drift (train.drift_every), its summary and its series (iteration, stored and mapped distance
    to fresh embeddings, their cosines, the rows' age, the map's scale min/max, the batch mean's noise)."""
    import csv

    from xbn.training.figures import FIGURE_COLUMNS

    epochs = list(csv.DictReader((metrics_dir / "train_epochs.csv").open()))
    record: dict[str, Any] = {"val_curve": [float(e["val_recall@1"]) if e.get("val_recall@1") else None
                                            for e in epochs]}
    # Issue 52: the memory path's own figures at every logged step (train.log_every), and the first step at which
    # the batch has collapsed (its images' mean pairwise cosine at or above COLLAPSED_COSINE).
    steps = [r for r in csv.DictReader((metrics_dir / "train_steps.csv").open()) if r.get("memory_loss")]
    if steps:
        columns = ("iteration", "loss", *FIGURE_COLUMNS)
        record["figure_columns"] = list(columns)
        record["figure_series"] = [[round(float(r[c]), 5) if r.get(c) else None for c in columns] for r in steps]
        record["collapse_iteration"] = next((int(r["iteration"]) for r in steps
                                             if float(r["batch_cosine"]) >= COLLAPSED_COSINE), None)
    if "memory_drift" not in summary:
        return record
    columns = ("iteration", "stored_drift_mean", "mapped_drift_mean", "stored_cosine", "mapped_cosine",
               "memory_age", "scale_min", "scale_max", "batch_mean_noise")
    rows = [r for r in csv.DictReader((metrics_dir / "train_steps.csv").open()) if r.get("stored_drift_mean")]
    record["memory_drift"] = summary["memory_drift"]
    record["drift_columns"] = list(columns)
    record["drift_series"] = [[round(float(r[c]), 5) if r.get(c) else None for c in columns] for r in rows]
    return record


def with_variants(run: dict[str, Any], derived: dict[str, str]) -> list[dict[str, Any]]:
    """The run, then a run of its own for each row the regime derives from this method's training (`derived`:
    row -> source method; the plain embedding under the refiner, the MPN at test time): same dataset, batch,
    seed and cost, so the pairing by seed holds. Another job's copy of a row (a refiner variant's plain
    embedding) is dropped: one row per seed."""
    variants = {name: values for name, values in run.pop("variants", {}).items()
                if derived.get(name) == run["method"]}
    shared = {k: run[k] for k in ("dataset", "batch", "seed", "git_commit", "train_s", "loadavg_before",
                                  "loadavg_after") if k in run}
    return [run, *({**shared, **values, "method": name, "derived_from": run["method"]}
                   for name, values in variants.items())]


def aggregate(runs: list[dict[str, Any]], methods: list[str] | None = None) -> list[dict[str, Any]]:
    """Mean and sample std over seeds per (dataset, method, batch), methods in the order of `methods`."""
    table = []
    keys = sorted({(r["dataset"], r["batch"]) for r in runs})
    for dataset, batch in keys:
        for method in methods or METHODS:
            sel = [r for r in runs if (r["dataset"], r["method"], r["batch"]) == (dataset, method, batch)
                   and "recall@1" in r]
            if not sel:
                continue
            row: dict[str, Any] = {"dataset": dataset, "method": method, "batch": batch, "seeds": len(sel)}
            for key in ("recall@1", "map@r", "val_recall@1", "rho_spectrum"):
                values = [r[key] for r in sel if r.get(key) is not None]
                if not values:
                    continue
                row[key] = statistics.mean(values)
                row[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else None
            row["train_s"] = statistics.mean(r["train_s"] for r in sel)
            table.append(row)
    return table


def render(result: dict[str, Any], dataset: str) -> str:
    def cell(r: dict[str, Any], key: str) -> str:
        if key not in r:  # a row derived from another run's training may lack a number (no val for the MPN)
            return ""
        return f"{r[key]:.4f} ± {r[key + '_std']:.4f}" if r[key + "_std"] is not None else f"{r[key]:.4f}"

    sel = [r for r in result["table"] if r["dataset"] == dataset]
    rho = any("rho_spectrum" in r for r in sel)  # Roth et al.'s spectral decay, when the runs measured it
    rows = [[r["method"], r["batch"], r["seeds"], cell(r, "recall@1"), cell(r, "map@r"), cell(r, "val_recall@1"),
             *([cell(r, "rho_spectrum") if "rho_spectrum" in r else ""] if rho else []), round(r["train_s"])]
            for r in sel]
    return markdown_table(["method", "batch", "seeds", "test R@1", "test MAP@R", "val R@1",
                           *(["rho (train)"] if rho else []), "train s"], rows)


def plot(result: dict[str, Any], path: Path, methods: list[str] | None = None) -> Path | None:
    """Test R@1 against batch size per method, one panel per dataset (seed 000's Figure 1 form)."""
    datasets = sorted({r["dataset"] for r in result["table"]})
    if not datasets:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from xbn.utils.io import atomic_path

    fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        for method in methods or METHODS:
            sel = sorted((r for r in result["table"] if r["dataset"] == dataset and r["method"] == method),
                         key=lambda r: r["batch"])
            if sel:
                ax.errorbar([r["batch"] for r in sel], [r["recall@1"] for r in sel],
                            yerr=[r["recall@1_std"] or 0 for r in sel], marker="o", capsize=3, label=method)
        batches = sorted({r["batch"] for r in result["table"] if r["dataset"] == dataset})
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size")
        ax.set_ylabel("test Recall@1 (mean ± std over seeds)")
        ax.set_title(dataset)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return path


def _settings(overrides: list[str]) -> dict[str, str]:
    """KEY=VALUE overrides as what they set, the last one of a key winning (as `xbn --set` applies them)."""
    return dict(o.split("=", 1) for o in overrides)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--datasets", nargs="+", choices=list(DATASETS), default=["glyphs", "omniglot"])
    parser.add_argument("--methods", nargs="+", help=f"default: {' '.join(GRID_METHODS)} (a regime's: all its own)")
    parser.add_argument("--batches", type=int, nargs="+", help="default: 16 64 (a regime's: its own)")
    parser.add_argument("--regime", choices=list(REGIMES), help="a seed method in its paper's regime "
                        "(benchmarks/regimes.py) instead of the memory methods")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel (processes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--device", default="cpu", help="train.device of every run (cuda: the workers share "
                        "the GPU; each still decodes its images in its own process)")
    parser.add_argument("--resume", action="store_true", help="keep the runs already in the results file")
    parser.add_argument("--output", help="results/<output>.json (default: grid, grid_<regime>, +_quick)")
    parser.add_argument("--quick", action="store_true", help="2 methods, 1 seed, 1 epoch, glyphs only")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a params override for every arm (repeatable), after the arm's own")
    parser.add_argument("--arm", dest="arms", action="append", nargs="+", default=[],
                        metavar="NAME BASE [KEY=VALUE ...]",
                        help="an arm of its own: arm BASE's overrides, then these (repeatable); runs with --methods "
                             "or, without it, after the default arms")


def main(argv: list[str]) -> int:
    import json

    parser = argparse.ArgumentParser(prog="python -m benchmarks grid", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    regime = REGIMES[args.regime] if args.regime else None
    table = dict(regime.methods if regime else METHODS)
    arms: dict[str, tuple[str, list[str]]] = {}  # --arm NAME BASE KEY=VALUE...: NAME -> (BASE, its overrides)
    for name, *rest in args.arms:
        if not rest or rest[0] not in table:
            parser.error(f"--arm {name}: needs a base arm (one of {', '.join(table)})")
        if bad := [o for o in rest[1:] if "=" not in o]:
            parser.error(f"--arm {name}: {', '.join(bad)} is not KEY=VALUE")
        # A name already in the table only as itself (a results file's command, from before the arm was named).
        if name in table and _settings(table[name]) != _settings([*table[rest[0]], *rest[1:]]):
            parser.error(f"--arm {name}: the name is taken by another arm ({' '.join(table[name])})")
        arms[name] = (rest[0], rest[1:])
        table[name] = [*table[rest[0]], *rest[1:]]
    output = "grid" + (f"_{args.regime}" if regime else "") + ("_quick" if args.quick else "")
    if args.quick:
        quick = {**QUICK, "output": None, **({"methods": list(regime.quick_methods), "batches": regime.batches}
                                              if regime else {})}
        for key, value in quick.items():
            setattr(args, key, value)
    args.output = args.output or output
    args.methods = args.methods or [*(regime.methods if regime else GRID_METHODS), *arms]
    args.batches = args.batches or (regime.batches if regime else [16, 64])
    if unknown := [m for m in args.methods if m not in table]:
        parser.error(f"--methods: unknown {', '.join(unknown)} (choose from {', '.join(table)})")
    path = RESULTS_DIR / f"{args.output}.json"
    old = json.loads(path.read_text()) if args.resume and path.exists() else {}
    earlier = old.get("settings", {})
    result: dict[str, Any] = {
        "benchmark": "memory methods x batch size x seed, test R@1 and MAP@R",
        "command": "python -m benchmarks grid " + " ".join(argv),
        # Every command that added runs to this file (--resume keeps the earlier runs).
        "commands": [*old.get("commands", [old["command"]] if "command" in old else []),
                     "python -m benchmarks grid " + " ".join(argv)],
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(PACKAGES),
        "settings": {**{k: getattr(args, k) for k in ("datasets", "methods", "batches", "seeds", "workers",
                                                     "threads", "device", "regime", "quick", "overrides")},
                     "arms": {**earlier.get("arms", {}), **{n: {"base": b, "overrides": o} for n, (b, o) in arms.items()}},
                     "regime": {"about": regime.about, "methods": {m: table[m] for m in args.methods}}
                     if regime else None,
                     # --resume with other datasets keeps the earlier ones' schedules and specs
                     "scale": SCALE, "scales": {**earlier.get("scales", {}),
                                                **{d: scale_of(d) for d in args.datasets}},
                     "datasets_spec": {**earlier.get("datasets_spec", {}),
                                       **{d: DATASETS[d] for d in args.datasets}},
                     "backbone": "tf_efficientnet_lite0 (offline ImageNet weights), memory.size=1.0"},
        "data": dict(old.get("data", {})), "table": [],
        # Each run names its commit and CPU: a --resume on another machine adds runs that do not pair with these
        # (the same seed trains a different model on another CPU's kernels).
        "runs": [{"git_commit": old.get("machine", {}).get("git_commit"), "cpu": old.get("machine", {}).get("cpu"),
                  **r} for r in old.get("runs", []) if "recall@1" in r],
    }
    done = {(r["dataset"], r["method"], r["batch"], r["seed"]) for r in result["runs"]}
    scheduled = regime.scheduled(args.methods) if regime else args.methods
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="xbn_grid_") as tmp:
        work = Path(tmp)
        # The params as they were at the start: an edit of params.yaml during the grid must not reach its runs.
        params_file = work / "params.yaml"
        params_file.write_text((REPO / "params.yaml").read_text())
        jobs = []
        for dataset in args.datasets:
            try:
                data, info = prepare(dataset, work)
            except FileNotFoundError as exc:
                print(f"grid: {dataset} skipped: {exc}", flush=True)
                continue
            result["data"][dataset] = info
            print(f"grid: {dataset}: {info['splits']}", flush=True)
            # Seed-major: a grid stopped early has whole seeds rather than whole methods.
            for seed in args.seeds:
                for batch in args.batches:
                    for method in scheduled:
                        if (dataset, method, batch, seed) in done:
                            continue
                        run_dir = work / "runs" / f"{dataset}_{method.replace('*', 'star')}_b{batch}_s{seed}"
                        steps = info["splits"]["train"]["images"] // batch  # the sampler's epoch, about
                        base, extra = arms.get(method, (method, []))
                        overrides = [*(regime.overrides(base, steps, args.quick) if regime else METHODS[base]),
                                     *extra, *args.overrides]
                        jobs.append(({"dataset": dataset, "method": method, "batch": batch, "seed": seed},
                                     run_overrides(data, overrides, batch, seed, run_dir, args.device)))
        result["plan"] = plan([key for key, _ in jobs], args.workers, result["machine"]["cpu"], args.device)
        print(f"grid: {len(jobs)} runs on {args.workers} worker(s) x {args.threads} thread(s); estimated "
              f"{result['plan']['estimated_hours']} h ({result['plan']['basis']})", flush=True)
        context = multiprocessing.get_context("spawn")
        with futures.ProcessPoolExecutor(args.workers, mp_context=context, initializer=exit_with_parent,
                                         initargs=(os.getpid(),)) as pool:
            pending = {pool.submit(run_one, overrides, args.threads, params_file): key for key, overrides in jobs}
            for i, future in enumerate(futures.as_completed(pending), 1):
                key = pending[future]
                try:
                    run = {**key, **future.result(), "git_commit": result["machine"]["git_commit"],
                           "cpu": result["machine"]["cpu"]}
                except Exception as exc:  # one failed configuration must not lose the others
                    run = {**key, "error": f"{type(exc).__name__}: {exc}"}
                result["runs"] += with_variants(run, regime.derived if regime else {})
                result["table"] = aggregate(result["runs"], list(table))  # every method with runs, --resume too
                result["elapsed_s"] = round(time.perf_counter() - started, 1)
                result["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
                write_result(args.output, result)
                shown = {k: run[k] for k in ("recall@1", "val_recall@1", "train_s", "error") if k in run}
                print(f"[{i}/{len(jobs)}] {key}: {shown}", flush=True)
    result["machine"]["git_commit_end"] = machine_info()["git_commit"]
    result["plot"] = str(plot(result, DOCS / f"{args.output}_recall.png", list(table)))
    write_result(args.output, result)
    for dataset in result["data"]:
        print(f"\n{dataset}\n{render(result, dataset)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
