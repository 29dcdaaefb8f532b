"""Every method on the glyph default through `dvc exp run -S ...`: R@1 and MAP@R on the glyph test split.

    python -m benchmarks methods [--only xbn axbn ...] [--set train.epochs=2 ...] [--keep]

The committed HEAD is cloned into a temporary folder (the project's checkout is never touched), `dvc repro`
runs the default once (generate, prepare, validate are then cached), and each method is one
`dvc exp run -S key=value ...` from the committed params.yaml, so every row is what a user gets from the
pipeline with that override and nothing else. `--set` reduces every run alike (for a quick look); the table
records it. Results are written after every method, so an interrupted run keeps what finished.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, machine_info, markdown_table, write_result
from benchmarks.pipeline_bench import clone, environment, reduce_params

PACKAGES = ("torch", "timm", "pytorch-metric-learning", "faiss-cpu", "dvc")
# Overrides in DVC's (Hydra's) syntax: a dict value merges into the existing one, so `~key` drops a key and
# `+key=value` adds one (`-S loss.miner_params={}` would keep pos_margin/neg_margin).
PROXY = ["~loss.params.temperature", "loss.miner=null", "memory.method=none"]  # the loss's own defaults
NO_MARGINS = ["~loss.miner_params.pos_margin", "~loss.miner_params.neg_margin"]
# XBM as measured before `memory.center_gradient: auto` centred it (issue 52): its rows keep their meaning.
UNCENTRED = "memory.center_gradient=false"
# (name, what it is, overrides of the committed params.yaml). `axbn` is the default: no override.
METHODS: list[tuple[str, str, list[str]]] = [
    ("none", "no memory", ["memory.method=none"]),
    ("xbm", "cross-batch memory (Wang et al. 2020)", ["memory.method=xbm", UNCENTRED]),
    ("xbm*", "XBM + minibatch loss", ["memory.method=xbm", "memory.add_batch_loss=true", UNCENTRED]),
    ("xbn", "XBN (seed 000, Eq. 6)", ["memory.method=xbn"]),
    ("axbn", "AXBN, Kalman (seed 000; the default)", []),
    ("ema", "EMA of the batch moments (seed 000, App. C)", ["memory.method=ema"]),
    # `xbn tune --set tune.lambda_mode=true --set tune.trials=12 --set tune.epochs=3 --set train.warmup_epochs=1`
    # on the glyph default (validation split) chose these; xbm/xbn at the same memory size separate the size
    # from the filter.
    ("axbn_tuned", "AXBN, r/q = 0.061, N = 100, memory 0.069 (xbn tune)", [
        "memory.kalman.q=1.0", "memory.kalman.r=0.0608", "memory.kalman.p0=10000.0",
        "memory.kalman.gain_interval=100", "memory.size=0.0692"]),
    ("xbm_small", "XBM, memory 0.069 of the training set",
     ["memory.method=xbm", "memory.size=0.0692", UNCENTRED]),
    ("xbn_small", "XBN, memory 0.069 of the training set", ["memory.method=xbn", "memory.size=0.0692"]),
    ("axbn_auto", "AXBN, noise estimated online", ["memory.method=axbn_auto"]),
    ("normsoftmax", "NormSoftmax, no memory", ["loss.name=NormalizedSoftmaxLoss", *PROXY]),
    ("memvir", "NormSoftmax + MemVir (seed 002)", ["loss.name=NormalizedSoftmaxLoss", *PROXY,
                                                  "loss.memvir.enabled=true", "train.lr_gamma=1"]),
    ("mpn", "Intra-Batch MPN (seed 004), no memory", ["model.mpn.enabled=true", "memory.method=none",
                                                     "model.mpn.test_time=true"]),
    ("refine", "AXBN + context refiner (seed 001)", ["refine.enabled=true"]),
    ("spc_r", "AXBN, SPC-R batches (seed 003)", ["train.sampler.name=spc_r"]),
    ("greedy_coreset", "AXBN, greedy-coreset batches", ["train.sampler.name=greedy_coreset"]),
    ("ddm", "AXBN, distance-distribution batches", ["train.sampler.name=ddm", "train.sampler.trials=16"]),
    ("frd", "AXBN, Frechet-distance batches", ["train.sampler.name=frd", "train.sampler.trials=16"]),
    # `+...seed`: DVC's YAML writer corrupts params.yaml when `~` empties a mapping that carries comments.
    ("random_miner", "AXBN, random triplets", ["loss.miner=RandomTripletMiner", *NO_MARGINS,
                                               "+loss.miner_params.seed=0"]),
    ("semihard", "AXBN, semi-hard triplets", ["loss.miner=TripletMarginMiner", *NO_MARGINS,
                                              "+loss.miner_params.type_of_triplets=semihard",
                                              "+loss.miner_params.margin=0.2"]),
    ("softhard", "AXBN, soft-hard triplets", ["loss.miner=SoftHardMiner", *NO_MARGINS,
                                              "+loss.miner_params.seed=0"]),
    ("distance_weighted", "AXBN, distance-weighted", ["loss.miner=DistanceWeightedMiner", *NO_MARGINS,
                                                      "+loss.miner_params.cutoff=0.5",
                                                      "+loss.miner_params.nonzero_loss_cutoff=1.4"]),
    ("rho", "AXBN + rho-regularization p=0.2", ["loss.rho.p_switch=0.2"]),
]


def run_method(repo: Path, overrides: list[str], log: Path) -> tuple[float, str | None]:
    """`dvc exp run -S ...` from the committed params.yaml; (wall seconds, error or None)."""
    subprocess.run(["git", "checkout", "-q", "--", "params.yaml"], cwd=repo, check=True)
    command = [str(Path(sys.executable).parent / "dvc"), "exp", "run"]  # not -q: it hides DVC's errors
    for item in overrides:
        command += ["-S", item]
    start = time.perf_counter()
    with open(log, "ab") as fh:
        fh.write(f"\n$ {' '.join(command)}\n".encode())
        fh.flush()
        done = subprocess.run(command, cwd=repo, env=environment(repo), stdout=fh, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    return seconds, None if done.returncode == 0 else f"dvc exp run exited {done.returncode} (see {log})"


def read_row(repo: Path) -> dict[str, Any]:
    metrics = json.loads((repo / "metrics/eval.json").read_text())
    train = json.loads((repo / "metrics/train.json").read_text())
    row = {"recall@1": metrics["recall@1"], "map@r": metrics["map@r"], "nmi": metrics.get("nmi"),
           "untrained_recall@1": metrics.get("untrained", {}).get("recall@1"),
           "best_val_recall@1": train.get("best_val_recall@1"), "train_seconds": train.get("train_seconds")}
    for extra in ("refined", "mpn"):  # seed 001 / seed 004's test-time variants, next to the plain metrics
        if extra in metrics:
            row[f"{extra}_recall@1"], row[f"{extra}_map@r"] = metrics[extra]["recall@1"], metrics[extra]["map@r"]
    refine = repo / "metrics/refine.json"
    if "refined" in metrics and refine.exists():  # which refiner epoch was kept, and what validation said
        chosen = json.loads(refine.read_text())
        row["refine"] = {k: chosen.get(k) for k in ("epoch", "served", "val_plain_recall@1",
                                                    "val_refined_recall@1")}
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=[m[0] for m in METHODS],
                        help="a subset of the methods; their rows replace those in an existing results file")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="params override applied to every run alike (key=value)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary clone (printed)")
    parser.add_argument("--output", default="methods")
    args = parser.parse_args(argv)
    command = "python -m benchmarks methods " + " ".join(sys.argv[2:] if argv is None else argv)
    tmp = Path(tempfile.mkdtemp(prefix="xbn_methods_"))
    repo, log = tmp / "repo", tmp / "log.txt"
    commit = clone(repo)
    if args.overrides:  # committed, so that every `dvc exp run` starts from the reduced params
        reduce_params(repo, args.overrides)
        subprocess.run(["git", "commit", "-qam", "benchmark: reduced params"], cwd=repo, check=True)
    result: dict[str, Any] = {
        "benchmark": "every method on the glyph default via dvc exp run, glyph test split",
        "command": command.strip(), "machine": machine_info(PACKAGES) | {"cloned_commit": commit},
        "settings": {"overrides_for_all": args.overrides}, "rows": []}
    kept = _rows_to_keep(args)
    dvc = str(Path(sys.executable).parent / "dvc")
    start = time.perf_counter()
    with open(log, "ab") as fh:  # the shared stages once, so the first method's time is its own
        subprocess.run([dvc, "repro", "-q", "validate"], cwd=repo, env=environment(repo), stdout=fh,
                       stderr=subprocess.STDOUT, check=True)
    result["shared_stages_s"] = round(time.perf_counter() - start, 1)
    for name, what, overrides in METHODS:
        if args.only and name not in args.only:
            continue
        seconds, error = run_method(repo, overrides, log)
        row = {"method": name, "what": what, "overrides": overrides, "seconds": round(seconds, 1),
               "commit": commit, "command": result["command"]}
        if error:
            row["error"] = error
        else:
            row.update(read_row(repo))
        result["rows"].append(row)
        write_result(args.output, result | {"rows": _in_order(kept + result["rows"])})
        print(f"{name}: {row.get('recall@1', row.get('error'))} ({seconds:.0f} s)", flush=True)
    result["rows"] = _in_order(kept + result["rows"])
    print(render(result))
    if args.keep or any("error" in r for r in result["rows"]):  # keep the log of a failed run
        print(f"kept {tmp}")
    else:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _rows_to_keep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """With --only, the other methods' rows of an earlier run with the same reductions (each row records its
    own commit and command)."""
    path = RESULTS_DIR / f"{args.output}.json"
    if not args.only or not path.exists():
        return []
    earlier = json.loads(path.read_text())
    if earlier.get("settings", {}).get("overrides_for_all") != args.overrides:
        return []
    rows = [r for r in earlier["rows"] if r["method"] not in args.only]
    for r in rows:
        r.setdefault("commit", earlier["machine"].get("cloned_commit"))
        r.setdefault("command", earlier["command"])
    return rows


def _in_order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rank = {name: i for i, (name, _, _) in enumerate(METHODS)}
    return sorted(rows, key=lambda r: rank.get(r["method"], len(rank)))


def _variant(row: dict[str, Any]) -> str:
    parts = [f"{k.split('_')[0]} R@1 {row[k]:.4f}" for k in ("refined_recall@1", "mpn_recall@1") if k in row]
    if refine := row.get("refine"):
        parts.append(f"(refiner epoch {refine['epoch']} kept, serving {refine['served']})")
    return " ".join(parts)


def render(result: dict[str, Any]) -> str:
    def num(row, key):
        value = row.get(key)
        return None if value is None else round(value, 4)

    rows = [[f"`{r['method']}`", r["what"], " ".join(f"`-S {o}`" for o in r["overrides"]) or "(default)",
             num(r, "recall@1") if "error" not in r else "failed", num(r, "map@r"), num(r, "best_val_recall@1"),
             _variant(r),
             r["seconds"]] for r in result["rows"]]
    return markdown_table(["method", "what", "override", "test R@1", "test MAP@R", "best val R@1", "variant",
                           "wall s"], rows)


if __name__ == "__main__":
    main()
