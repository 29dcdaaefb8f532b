"""Retrieval evaluation at SOP scale: xbn vs pytorch-metric-learning's AccuracyCalculator vs scikit-learn.

    python -m benchmarks eval [--quick] [--sizes 10000 60000 120000] [--no-nmi] [--contenders ...]

For each size N: clustered random unit vectors (d = 512, 2 to 8 images per class, 5 on average, like SOP),
evaluated leave-one-out by each contender in its own child process (time of the computation, peak RSS of
the process), capped at --mem-limit-gb so that a contender that needs more is recorded as out of memory.
  ours     xbn.evaluation.retrieval_metrics (Recall@k, MAP@R, R-precision) + its NMI (faiss k-means), on the
           path this CPU picks (a bf16 first pass where bf16 products are fast, else float32)
  ours-fp32  the same with the float32 path forced (XBN_CPU_BF16=0): what a CPU without fast bf16 runs;
           its metrics must equal ours' exactly
  pml      AccuracyCalculator(precision_at_1, r_precision, mean_average_precision_at_r, k="max_bin_count"),
           then its NMI; precision_at_1 is Recall@1
  sklearn  NearestNeighbors(algorithm="brute") + the metrics from their definitions in numpy; no NMI (a
           scikit-learn KMeans with N/5 clusters is not practical, and would not be the same clustering)
Metric values are compared with ours where both finished.

The exact search is bound by its matrix products, so the same run measures what this machine's GEMM gives:
in each ours child, right after its search, float32 and bfloat16 `a @ b.T` of the search's block shape
(`BLOCK` x d by d x `BLOCK`, torch, the same threads, into a reused result as the search does), and
`search_fraction_of_gemm` = the FLOPs the symmetric leave-one-out search does (`self_search_flops`) / its
time / the float32 GEMM rate (`search_fraction_of_bf16_gemm`: of the bfloat16 rate). Each ours row records
which first pass ran (`search_path`), how many queries its bound could not certify (`fallback_queries`,
searched again in float32; `exhaustive_queries`, scored against every reference) and its speed-up over
AccuracyCalculator. Once per run, float32 and bfloat16 GEMMs of one smaller shape side by side with the
CPU's flags.
Writes benchmarks/results/eval.json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    current_rss_gb,
    machine_info,
    markdown_table,
    python_module_argv,
    run_child,
    write_result,
)
from benchmarks.verdicts import verdict

CONTENDERS = ("ours", "ours-fp32", "pml", "sklearn")
OURS = ("ours", "ours-fp32")
KS = (1, 2, 4, 8, 10, 100)
# The seed faiss.Kmeans uses by default, hence PML's: ours uses it too so that the NMI values can be compared.
KMEANS_SEED = 1234
# Per-dimension noise around the class centres: Recall@1 ≈ 0.72, MAP@R ≈ 0.39 at 10k (SOP-like), lower
NOISE = 2.4
PACKAGES = ("numpy", "faiss-cpu", "torch", "scikit-learn", "pytorch-metric-learning")
BLOCK = 4096  # retrieval_metrics' chunk_size: the row blocks of the symmetric search
DTYPE_SHAPE = 1024  # the float32-vs-bfloat16 comparison: small, since bfloat16 without AVX-512 is slow


def make_embeddings(n: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """n clustered unit vectors, classes of 2 to 8 images (the last class may be smaller)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(2, 9, n // 2)
    labels = np.repeat(np.arange(len(sizes)), sizes)[:n]
    centres = rng.standard_normal((labels[-1] + 1, dim), dtype=np.float32)
    x = rng.standard_normal((n, dim), dtype=np.float32)
    x *= NOISE
    x += centres[labels]
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x, labels


def self_search_flops(n: int, dim: int, block: int = BLOCK) -> int:
    """FLOPs of knn_search's symmetric leave-one-out path: each diagonal block b_i x b_i in full and each block
    above it once, 2 FLOPs per multiply-add: 2d(sum b_i^2 + sum_{i<j} b_i b_j) = d(n^2 + sum b_i^2)."""
    sizes = [min(block, n - start) for start in range(0, n, block)]
    return dim * (n * n + sum(b * b for b in sizes))


def gemm_gflops(rows: int, dim: int, dtype: str = "float32", min_seconds: float = 1.0) -> float:
    """GFLOP/s of torch's `a @ b.T` with a, b [rows, dim] of `dtype`, on this process's torch threads, into one
    reused result (a fresh one per product would add page faults the search does not pay): repeated until
    `min_seconds` have passed, after one untimed product."""
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randn(rows, dim, generator=g).to(getattr(torch, dtype))
    b = torch.randn(rows, dim, generator=g).to(getattr(torch, dtype))
    out = torch.empty(rows, rows, dtype=a.dtype)
    with torch.no_grad():
        torch.matmul(a, b.T, out=out)
        reps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_seconds or reps == 0:
            torch.matmul(a, b.T, out=out)
            reps += 1
    return 2 * rows * rows * dim * reps / elapsed / 1e9


def dtype_comparison(dim: int) -> dict[str, Any]:
    """float32 and bfloat16 GEMM side by side at one shape, with the threads and CPU capability torch used."""
    import torch

    return {"shape": [DTYPE_SHAPE, dim, DTYPE_SHAPE], "threads": torch.get_num_threads(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "float32_gflops": round(gemm_gflops(DTYPE_SHAPE, dim, "float32"), 2),
            "bfloat16_gflops": round(gemm_gflops(DTYPE_SHAPE, dim, "bfloat16"), 2)}


# ----------------------------------------------------------------------------------------------------------
# Children: one contender, one size. Each prints nothing but writes a JSON of timings and metric values.


def _run_ours(x: np.ndarray, labels: np.ndarray, nmi: bool) -> dict[str, Any]:
    from xbn.evaluation import retrieval_metrics
    from xbn.evaluation.metrics import nmi_score

    # knn_s: the metrics AccuracyCalculator computes here (R@1 = precision@1, MAP@R, R-precision: k = the
    # largest class), the like-for-like time; knn_all_ks_s: also R@k up to k = 100, what `xbn evaluate` does.
    start = time.perf_counter()
    retrieval_metrics(x, labels, ks=(1,), nmi=False)
    out: dict[str, Any] = {"knn_s": time.perf_counter() - start}
    start = time.perf_counter()
    metrics = retrieval_metrics(x, labels, ks=KS, nmi=False)
    out |= {"knn_all_ks_s": time.perf_counter() - start, "metrics": metrics}
    if nmi:
        start = time.perf_counter()
        metrics["nmi"] = nmi_score(x, labels, seed=KMEANS_SEED)
        out["nmi_s"] = time.perf_counter() - start
    out |= _search_vs_gemm(x, labels)
    return out


def _search_vs_gemm(x: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    """The search alone (the like-for-like k), then the GEMMs of its block shape, back to back."""
    import torch

    from xbn.evaluation.knn import knn_search

    k = max(1, int(np.bincount(labels).max()) - 1)  # retrieval_metrics' k for ks=(1,): the largest R
    stats: dict[str, Any] = {}
    start = time.perf_counter()
    knn_search(x, x, k, exclude_self=True, chunk_size=BLOCK, stats=stats)
    search_s = time.perf_counter() - start
    flops = self_search_flops(len(x), x.shape[1], BLOCK)
    gflops = flops / search_s / 1e9
    gemm = gemm_gflops(min(BLOCK, len(x)), x.shape[1])
    gemm_bf16 = gemm_gflops(min(BLOCK, len(x)), x.shape[1], "bfloat16")
    return {"search_s": search_s, "search_k": k, "search_flops": flops, "search_gflops": round(gflops, 2),
            "search_path": stats["path"], "search_candidates": stats["candidates"],
            "fallback_queries": stats["fallback_queries"], "exhaustive_queries": stats["exhaustive_queries"],
            "gemm_block": min(BLOCK, len(x)), "gemm_float32_gflops": round(gemm, 2),
            "gemm_bfloat16_gflops": round(gemm_bf16, 2), "gemm_threads": torch.get_num_threads(),
            "search_fraction_of_gemm": round(gflops / gemm, 4),
            "search_fraction_of_bf16_gemm": round(gflops / gemm_bf16, 4)}


def _run_pml(x: np.ndarray, labels: np.ndarray, nmi: bool) -> dict[str, Any]:
    import torch
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    cpu = torch.device("cpu")
    include = ("precision_at_1", "r_precision", "mean_average_precision_at_r")
    start = time.perf_counter()
    res = AccuracyCalculator(include=include, k="max_bin_count", device=cpu).get_accuracy(x, labels)
    out: dict[str, Any] = {"knn_s": time.perf_counter() - start}
    metrics = {
        "recall@1": res["precision_at_1"],
        "map@r": res["mean_average_precision_at_r"],
        "r_precision": res["r_precision"],
    }
    if nmi:
        start = time.perf_counter()
        metrics["nmi"] = AccuracyCalculator(include=("NMI",), device=cpu).get_accuracy(x, labels)["NMI"]
        out["nmi_s"] = time.perf_counter() - start
    out["metrics"] = metrics
    return out


def _run_sklearn(x: np.ndarray, labels: np.ndarray, nmi: bool) -> dict[str, Any]:
    from sklearn.neighbors import NearestNeighbors

    start = time.perf_counter()
    counts = np.bincount(labels)[labels] - 1  # R: the other images of the query's class
    k = min(max(max(KS), int(counts.max())), len(x) - 1)
    # Euclidean ranks unit vectors like cosine, and is scikit-learn's fast (GEMM) brute-force path.
    # kneighbors() without X leaves each point out of its own neighbours.
    idx = NearestNeighbors(n_neighbors=k, algorithm="brute").fit(x).kneighbors(return_distance=False)
    keep = counts > 0
    correct = labels[idx[keep]] == labels[keep, None]
    r = counts[keep]
    metrics: dict[str, Any] = {f"recall@{k_}": float(correct[:, :k_].any(axis=1).mean()) for k_ in KS}
    within_r = np.arange(k) < r[:, None]
    precision_at_i = np.cumsum(correct, axis=1) / np.arange(1, k + 1)
    metrics["map@r"] = float(((precision_at_i * correct * within_r).sum(axis=1) / r).mean())
    metrics["r_precision"] = float(((correct & within_r).sum(axis=1) / r).mean())
    return {"knn_s": time.perf_counter() - start, "metrics": metrics}


RUNNERS = {"ours": _run_ours, "ours-fp32": _run_ours, "pml": _run_pml, "sklearn": _run_sklearn}
LIBRARIES = {
    # metrics imports scikit-learn lazily (NMI) and torch in the leave-one-out search: loaded before timing,
    # as pml's torch is.
    "ours": ("xbn.evaluation", "sklearn.metrics", "torch"),
    "ours-fp32": ("xbn.evaluation", "sklearn.metrics", "torch"),
    "pml": ("pytorch_metric_learning.utils.accuracy_calculator",),
    "sklearn": ("sklearn.neighbors",),
}


def child_main(contender: str, data_dir: Path, result_path: Path, nmi: bool) -> None:
    if contender == "ours-fp32":
        from xbn.utils.cpu import FORCE_ENV

        os.environ[FORCE_ENV] = "0"
    x = np.load(data_dir / "x.npy")
    labels = np.load(data_dir / "labels.npy")
    # Import the contender's libraries before measuring the baseline, so the baseline is what it costs to
    # have the data and the library loaded, and the peak minus it is the computation's own memory.
    for module in LIBRARIES[contender]:
        importlib.import_module(module)
    baseline = current_rss_gb()
    out = RUNNERS[contender](x, labels, nmi)
    out["baseline_rss_gb"] = baseline
    result_path.write_text(json.dumps(out, default=float))


# ----------------------------------------------------------------------------------------------------------
# Parent: data, children, comparison, table.


def run_size(n: int, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    x, labels = make_embeddings(n, args.dim, args.seed)
    data_dir = work / f"n{n}"
    data_dir.mkdir()
    np.save(data_dir / "x.npy", x)
    np.save(data_dir / "labels.npy", labels)
    rows = []
    for contender in args.contenders:
        result_path = data_dir / f"{contender}.json"
        argv = python_module_argv("benchmarks.eval_bench", "--child", contender, "--data", str(data_dir),
                                  "--result", str(result_path), *(["--no-nmi"] if args.no_nmi else []))
        print(f"N={n}: {contender} ...", file=sys.stderr, flush=True)
        # The machine is shared: the load average says whether other work competed for the cores.
        load_before = os.getloadavg()[0]
        run = run_child(argv, mem_limit_gb=args.mem_limit_gb, timeout_s=args.timeout_s,
                        log_path=data_dir / f"{contender}.log")
        row: dict[str, Any] = {"n": n, "classes": int(labels[-1]) + 1, "contender": contender,
                               "peak_rss_gb": run.peak_rss_gb, "wall_s": run.wall_s,
                               "loadavg_1min_before": load_before}
        if run.ok:
            row |= json.loads(result_path.read_text()) | {"status": "ok"}
            row["total_s"] = row["knn_s"] + row.get("nmi_s", 0.0)
        elif run.out_of_memory:
            row["status"] = f"out of memory at {args.mem_limit_gb:g} GB"
        elif run.timed_out:
            row["status"] = f"timed out after {args.timeout_s:g} s"
        else:
            row["status"] = f"failed (exit {run.returncode})"
        if run.returncode == -signal.SIGKILL:
            row["detail"] = "killed by the watchdog"
        elif not run.ok:  # the error's last line, e.g. which allocation failed
            row["detail"] = (run.log_tail.strip().splitlines() or [""])[-1][-300:]
        print(f"  {row['status']}, {run.wall_s:.1f} s, peak RSS {run.peak_rss_gb:.2f} GB", file=sys.stderr)
        rows.append(row)
    _compare_with_ours(rows)
    return rows


def _compare_with_ours(rows: list[dict[str, Any]]) -> None:
    """Add each finished contender's largest absolute metric difference with ours, over shared keys."""
    ours = next((r["metrics"] for r in rows if r["contender"] == "ours" and "metrics" in r), None)
    for row in rows:
        if ours is None or row["contender"] == "ours" or "metrics" not in row:
            continue
        shared = sorted(set(ours) & set(row["metrics"]) - {"num_queries", "num_references"})
        row["max_abs_diff_vs_ours"] = max(abs(ours[k] - row["metrics"][k]) for k in shared)
        row["compared_keys"] = shared


def derive(rows: list[dict[str, Any]]) -> None:
    """Add each finished contender's time ratio to ours at the same N (`knn_ratio_vs_ours`: the like-for-like
    kNN metrics, or with R@1..100 for scikit-learn, which computes those; `total_ratio_vs_ours` with NMI), and
    to each ours row its speed-up over AccuracyCalculator (`speedup_vs_pml`, the kNN metrics)."""
    by_key = {(r["n"], r["contender"]): r for r in rows}
    for r in rows:
        ours = by_key.get((r["n"], "ours"))
        pml = by_key.get((r["n"], "pml"))
        if r["contender"] in OURS and pml and pml["status"] == "ok" and r["status"] == "ok":
            r["speedup_vs_pml"] = round(pml["knn_s"] / r["knn_s"], 3)
        if r["contender"] == "ours" or not ours or ours["status"] != "ok" or r["status"] != "ok":
            continue
        mine = ours.get("knn_all_ks_s", ours["knn_s"]) if r["contender"] == "sklearn" else ours["knn_s"]
        r["knn_ratio_vs_ours"] = round(r["knn_s"] / mine, 3)
        if "nmi_s" in r and "nmi_s" in ours:
            r["total_ratio_vs_ours"] = round(r["total_s"] / ours["total_s"], 3)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluation's targets, each with its measured value and verdict (single measurements: the interval
    is the value itself). Speed-ups over AccuracyCalculator at the largest N where both finished: 3x on the
    bf16 path, 2x on the float32 path (a CPU without fast bf16; ours-fp32 stands in for it here); the float32
    search's share of the float32 GEMM rate (ours-fp32's where both ran) and ours' peak memory at the largest N;
    metrics equal to AccuracyCalculator's, scikit-learn's and, exactly, between our two paths."""
    ok = [r for r in rows if r["status"] == "ok"]
    out = []
    for contender in OURS:
        timed = [r for r in ok if r["contender"] == contender and "speedup_vs_pml" in r]
        if timed:
            r = max(timed, key=lambda r: r["n"])
            out.append({"what": f"AccuracyCalculator time / {contender} (kNN metrics)", "n": r["n"],
                        "value": r["speedup_vs_pml"], "path": r.get("search_path", "float32"),
                        "at_least": 2.0 if r.get("search_path") == "float32" else 3.0})
    # files from before the bf16 path have no search_path: their search was float32
    fp32 = [r for r in ok if r["contender"] in OURS and "search_fraction_of_gemm" in r
            and r.get("search_path", "float32") == "float32"]
    if fp32:
        r = max(fp32, key=lambda r: (r["n"], r["contender"] == "ours-fp32"))
        out.append({"what": "search GFLOP/s / float32 GEMM GFLOP/s", "n": r["n"], "contender": r["contender"],
                    "value": r["search_fraction_of_gemm"], "at_least": 0.85})
    ours = [r for r in ok if r["contender"] == "ours"]
    if ours:
        r = max(ours, key=lambda r: r["n"])
        out.append({"what": "ours' peak RSS, GB", "n": r["n"], "value": round(r["peak_rss_gb"], 3),
                    "at_most": 2.0})
    for contender, most in (("ours-fp32", 0.0), ("pml", 1e-9), ("sklearn", 1e-9)):
        diffs = [r for r in ok if r["contender"] == contender and "max_abs_diff_vs_ours" in r]
        if diffs:
            r = max(diffs, key=lambda r: r["max_abs_diff_vs_ours"])
            out.append({"what": f"largest absolute metric difference, {contender} vs ours", "n": r["n"],
                        "value": r["max_abs_diff_vs_ours"], "at_most": most})
    for t in out:
        bound = {k: t[k] for k in ("at_most", "at_least") if k in t}
        t["verdict"] = verdict(t["value"], t["value"], **bound)
    return out


def render(rows: list[dict[str, Any]]) -> str:
    headers = ["N", "contender", "status", "kNN metrics s", "with R@1..100 s", "NMI s", "total s", "peak RSS GB",
               "baseline RSS GB", "R@1", "MAP@R", "RP", "NMI", "max abs diff vs ours", "kNN time / ours",
               "total time / ours", "AccuracyCalculator time / this"]
    table = []
    for r in rows:
        m = r.get("metrics", {})
        table.append([r["n"], r["contender"], r["status"], r.get("knn_s"), r.get("knn_all_ks_s"), r.get("nmi_s"),
                      r.get("total_s"),
                      r["peak_rss_gb"] if r["status"] == "ok" else None, r.get("baseline_rss_gb"),
                      m.get("recall@1"), m.get("map@r"), m.get("r_precision"), m.get("nmi"),
                      r.get("max_abs_diff_vs_ours"), r.get("knn_ratio_vs_ours"), r.get("total_ratio_vs_ours"),
                      r.get("speedup_vs_pml")])
    return markdown_table(headers, table)


def render_search(rows: list[dict[str, Any]]) -> str:
    """Ours' search against the GEMM rates measured right after it."""
    keys = ["n", "contender", "search_path", "search_k", "search_candidates", "fallback_queries",
            "exhaustive_queries", "search_s", "search_flops", "search_gflops", "gemm_block", "gemm_threads",
            "gemm_float32_gflops", "gemm_bfloat16_gflops", "search_fraction_of_gemm",
            "search_fraction_of_bf16_gemm"]
    table = [[r.get(key) for key in keys] for r in rows if r["contender"] in OURS and "search_s" in r]
    return markdown_table(["N", "contender", "first pass", "k", "candidates", "fallback queries",
                           "exhaustive queries", "search s", "FLOPs (d(N^2 + sum b^2))", "search GFLOP/s",
                           "GEMM block", "threads", "float32 GEMM GFLOP/s", "bfloat16 GEMM GFLOP/s",
                           "fraction of float32", "fraction of bfloat16"], table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 60_000, 120_000])
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-nmi", action="store_true", help="skip NMI (k-means dominates the time)")
    parser.add_argument("--mem-limit-gb", type=float, default=12.0)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--output", default="eval", help="results name: benchmarks/results/<name>.json")
    parser.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(args.child, args.data, args.result, nmi=not args.no_nmi)
        return

    command = "python -m benchmarks.eval_bench " + " ".join(sys.argv[1:] if argv is None else argv)
    rows: list[dict[str, Any]] = []
    dtypes = dtype_comparison(args.dim)
    print(f"GEMM {dtypes['shape']}: float32 {dtypes['float32_gflops']} GFLOP/s, bfloat16 "
          f"{dtypes['bfloat16_gflops']} GFLOP/s", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="eval_bench_") as tmp:
        for n in args.sizes:
            rows += run_size(n, args, Path(tmp))
    derive(rows)
    report = render(rows)
    path = write_result(args.output, {
        "benchmark": "retrieval evaluation, leave-one-out, clustered unit vectors",
        "command": command.strip(),
        "machine": machine_info(PACKAGES),
        "gemm_dtypes": dtypes,
        "targets": targets(rows),
        "settings": {"dim": args.dim, "images_per_class": "2-8 (mean 5)", "noise": NOISE, "ks": KS,
                     "seed": args.seed, "kmeans_seed": KMEANS_SEED, "nmi": not args.no_nmi,
                     "mem_limit_gb": args.mem_limit_gb, "timeout_s": args.timeout_s},
        "rows": rows,
    })
    print(report)
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    if "--child" in sys.argv:
        main()
    else:
        from benchmarks.__main__ import main as cli

        sys.exit(cli(["eval", *sys.argv[1:]]))
