"""A catalogue-scale index (issue 29, item 4): the on-disk IVF-PQ with its memory-mapped fp16 re-rank, served.

    python -m benchmarks bigindex [--quick] [--n ROWS] [--workdir DIR] [--keep] [--output NAME]

1. Generate: N unit vectors of 512 dimensions in shards of `shard_rows` (parquet files in `xbn embed`'s format,
   one shard in memory at a time, each from its own seed): clusters of `ROWS_PER_CLUSTER` rows (4000 clusters
   at 10M), a row its cluster's Gaussian centre plus Gaussian noise (`NOISE` a dimension against the centre's
   1), so same-cluster cosine is about 0.5 and others about 0, the top-10 a matter of the noise. The queries
   are new rows of existing clusters, held out of the catalogue.
2. Build with the code `xbn index --shards` runs (`xbn.serving.shards.build_sharded`): IVF-PQ (`PQ_M` bytes a
   row), `nlist` = N / `ROWS_PER_CELL`, trained on 64 rows a cell, the lists merged into the memory-mapped
   `index.ivfdata`, the fp16 store written shard by shard, k_factor tuned to `TUNE_RECALL` on catalogue rows.
   Each phase's seconds (index.json's `build_s`) and every file's size are recorded.
3. Exact top-10 of the held-out queries, streamed over the shards (a faiss IndexFlatIP a shard, top-k merged);
   then the raw shards are deleted (only the index folder is served).
4. Serve: a fresh process loads the folder with `CatalogueIndex.load` (what `xbn serve` and `xbn search` do:
   sha256 of every file, then the lists and the store memory-mapped) and serves the real app (`create_app` on
   uvicorn, loopback) with serving_bench's replay model: a 1-pixel PNG is uploaded and decoded, and the model
   answers with the next held-out query's embedding instead of a forward pass. So what a request times is
   the HTTP round trip, multipart, decode of the tiny PNG, the IVF-PQ search, the re-rank from the mapped store,
   the id map and the JSON; not an embedding network. The held-out queries are sent first, one at a time, and
   their answers scored against the exact top-10 (recall@10 of what `/search` returns); then `warmup`
   requests, then `sequential` timed ones, one at a time, for p50/p99. The server's peak resident memory over
   all of these is its VmHWM (reset with /proc/PID/clear_refs once it has loaded, so it is the serving window's
   peak, not the load's), with RssAnon and RssFile at the end and psutil's RSS sampled every 50 ms.

The p99's interval is the distribution-free 95% interval of the order statistics (serving_bench.
quantile_interval); a target is met when its whole interval is on its side. Writes benchmarks/results/
bigindex.json (10M rows), bigindex_quick.json (--quick: 200 000 rows) or bigindex_n<N>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import markdown_table, write_result
from benchmarks.verdicts import verdict

DIM, K = 512, 10
FULL = {"rows": 10_000_000, "shard_rows": 500_000, "queries": 1000, "warmup": 50, "sequential": 1000}
QUICK = {"rows": 200_000, "shard_rows": 50_000, "queries": 1000, "warmup": 50, "sequential": 500}
ROWS_PER_CLUSTER = 2500  # 4000 clusters at 10M ("a few thousand Gaussian centres")
NOISE = 1.0  # per dimension, against the centres' 1: same-cluster cosine about 1 / (1 + NOISE^2)
# Rows a cell: nlist 5000 at 10M (about one cluster a cell). Fewer, larger cells than faiss's 4 sqrt(N)
# (12 649): training costs nlist^2 x 64 rows a cell and assigning the rows N x nlist, both GEMMs on this
# machine's 2 cores, while a query scans only nprobe x 2000 codes.
ROWS_PER_CELL = 2000
# nprobe 8: on --quick recall@10 was the same (0.968) from nprobe 4 to 64, a cell holding about one cluster.
PQ_M, NPROBE, TUNE_RECALL = 64, 8, 0.95  # 64 bytes a row (640 MB of codes at 10M)
RECALL, P99_MS, RSS_GB = 0.9, 50.0, 4.0  # issue 29's targets at 10M rows
SEED = 0


# ---------------------------------------------------------------------------------------------------------
# Derivations (tested in tests/bench/test_bigindex_bench.py)


def cluster_centres(clusters: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, 0]).standard_normal((clusters, DIM), dtype=np.float32)


def clustered_rows(n: int, centres: np.ndarray, seed: list[int]) -> np.ndarray:
    """`n` unit rows, each a random centre of `centres` plus Gaussian noise; the same `seed`, the same rows."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, centres.shape[1]), dtype=np.float32)
    x *= NOISE
    x += centres[rng.integers(0, len(centres), n)]
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def shard_sizes(rows: int, shard_rows: int) -> list[int]:
    return [min(shard_rows, rows - start) for start in range(0, rows, shard_rows)]


def merge_top_k(best: tuple[np.ndarray, np.ndarray], found: tuple[np.ndarray, np.ndarray], k: int):
    """The top-k of two (scores, ids) lists of each query, best first (ties: the earlier list, then order)."""
    scores, ids = np.concatenate([best[0], found[0]], 1), np.concatenate([best[1], found[1]], 1)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)


def recall_at_k(exact: np.ndarray, got: list[list[int]], k: int = K) -> float:
    """Mean fraction of each query's exact top-k found in its answer's top-k."""
    return float(np.mean([len(set(e[:k].tolist()) & set(g[:k])) / k for e, g in zip(exact, got)]))


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 29's item-4 targets, each read from the measured values."""
    s, rows = data["serve"], data["rows"]
    p99 = s["http_sequential_ms"]["p99"]
    return [
        {"what": f"recall@10 of /search vs exact >= {RECALL}, {rows} rows, {s['queries']} held-out queries",
         "value": s["recall"], "verdict": verdict(s["recall"], s["recall"], at_least=RECALL), "at_least": RECALL},
        {"what": f"/search p99 (ms) one at a time <= {P99_MS:g}, {rows} rows",
         "value": f"p99 {p99['value']} [{p99['low']}, {p99['high']}]",
         "verdict": verdict(p99["low"], p99["high"], at_most=P99_MS), "at_most": P99_MS},
        {"what": f"serving process's peak resident memory (GB) <= {RSS_GB:g}, {rows} rows",
         "value": s["peak_rss_gb"], "verdict": verdict(s["peak_rss_gb"], s["peak_rss_gb"], at_most=RSS_GB),
         "at_most": RSS_GB},
    ]


# ---------------------------------------------------------------------------------------------------------
# The workload


def write_shards(folder: Path, sizes: list[int], centres: np.ndarray, seed: int) -> tuple[list[Path], float]:
    """One parquet file a shard in `xbn embed`'s format (path, embedding; the model's sha256 and dimension in
    the schema), generated and written one at a time; (paths, seconds)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    start, paths, first = time.perf_counter(), [], 0
    for i, n in enumerate(sizes):
        x = clustered_rows(n, centres, [seed, 1, i])
        offsets = pa.array(np.arange(n + 1, dtype=np.int32) * DIM)
        table = pa.table({
            "path": pa.array([f"item/{r}.jpg" for r in range(first, first + n)], pa.string()),
            "embedding": pa.ListArray.from_arrays(offsets, pa.array(x.reshape(-1), pa.float32())),
        }).replace_schema_metadata({b"xbn.model_sha256": b"bigindex-bench", b"xbn.embedding_dim": str(DIM).encode()})
        del x
        paths.append(folder / f"part-{i:04d}.parquet")
        pq.write_table(table, paths[-1], compression="none")  # random floats do not compress
        first += n
    return paths, time.perf_counter() - start


def exact_top_k(queries: np.ndarray, shards: list[Path], k: int = K) -> np.ndarray:
    """The exact top-k catalogue rows of each query (inner product), one shard in memory at a time."""
    import faiss

    from xbn.serving.embed_job import read_embeddings

    best = (np.full((len(queries), k), -np.inf, np.float32), np.full((len(queries), k), -1, np.int64))
    first = 0
    for shard in shards:
        _, x = read_embeddings(shard)
        flat = faiss.IndexFlatIP(DIM)
        flat.add(x)
        scores, ids = flat.search(queries, k)
        best = merge_top_k(best, (scores, ids + first), k)
        first += len(x)
        del flat, x
    return best[1]


def build(shards: list[Path], folder: Path, rows: int, nprobe: int) -> tuple[dict[str, Any], Any]:
    from xbn.config import IndexConfig
    from xbn.serving.shards import build_sharded

    cfg = IndexConfig(type="ivf_pq", nlist=max(1, rows // ROWS_PER_CELL), nprobe=nprobe, pq_m=PQ_M, pq_nbits=8,
                      refine="fp16", target_recall=TUNE_RECALL, seed=SEED)
    start = time.perf_counter()
    built = build_sharded(shards, folder, cfg)
    wall = time.perf_counter() - start
    meta = built.meta
    return {"nlist": cfg.nlist, "nprobe": nprobe, "pq_m": PQ_M, "pq_nbits": 8, "refine": "fp16",
            "k_factor": meta["params"]["k_factor"], "k_factor_ladder": meta["k_factor_tuning"]["ladder"],
            "tune_target": TUNE_RECALL, "build_recall": round(meta["recall@10"], 4),
            "build_s": meta["build_s"], "build_wall_s": round(wall, 1), **disk_use(folder)}, built


def disk_use(folder: Path) -> dict[str, Any]:
    sizes = {p.name: p.stat().st_size for p in sorted(folder.iterdir())}
    return {"index_bytes": sizes, "index_gb": {name: round(n / 2**30, 3) for name, n in sizes.items()},
            "index_total_gb": round(sum(sizes.values()) / 2**30, 3)}


def nprobe_curve(built: Any, queries: np.ndarray, exact: np.ndarray, nprobe: int) -> list[dict[str, Any]]:
    """recall@10 of the built index (in this process) on the held-out queries at nprobe / 4 ... 4 nprobe, at
    the tuned k_factor: where the chosen nprobe sits."""
    from xbn.serving.index import set_search_params

    curve = []
    for probes in sorted({max(1, nprobe // 4), max(1, nprobe // 2), nprobe, 2 * nprobe, 4 * nprobe}):
        set_search_params(built.index, {"nprobe": probes})
        start = time.perf_counter()
        _, rows = built.index.search(queries, K)
        curve.append({"nprobe": probes, "recall": round(recall_at_k(exact, rows.tolist()), 4),
                      "ms_per_query": round((time.perf_counter() - start) * 1000 / len(queries), 3)})
    set_search_params(built.index, {"nprobe": nprobe})
    return curve


# ---------------------------------------------------------------------------------------------------------
# Serving, in a process of its own


def server(index_dir: str, queries_path: str, port: int, ready_path: str) -> None:
    """The served process: load the index folder as `xbn serve` does, then the real app on uvicorn."""
    from benchmarks.serving_bench import ReplaySource
    from xbn.config import ServeConfig
    from xbn.serving.http import create_app, serve
    from xbn.serving.index import CatalogueIndex

    start = time.perf_counter()
    index = CatalogueIndex.load(index_dir)
    load_s = time.perf_counter() - start
    app = create_app(ReplaySource(index, np.load(queries_path)), ServeConfig(poll_interval_s=0), token=None)
    Path(ready_path).write_text(json.dumps({"load_s": round(load_s, 2), "type": type(index.index).__name__}))
    serve(app, "127.0.0.1", port, log_level="warning")


def _status(pid: int) -> dict[str, float]:
    """VmRSS, VmHWM, RssAnon, RssFile of `pid`, in GB."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = round(int(line.split()[1]) * 1024 / 2**30, 3)
    return out


def bench_serve(index_dir: Path, queries: np.ndarray, exact: np.ndarray, settings: dict[str, Any]) -> dict[str, Any]:
    import httpx
    import psutil

    from benchmarks.serving_bench import summary_ms, tiny_png

    work = index_dir.parent
    np.save(work / "queries.npy", queries)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = work / "ready.json"
    ready.unlink(missing_ok=True)
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; from benchmarks.bigindex_bench import server; server(*sys.argv[1:3], "
         "int(sys.argv[3]), sys.argv[4])", str(index_dir), str(work / "queries.npy"), str(port), str(ready)],
        cwd=Path(__file__).resolve().parent.parent)
    url, png = f"http://127.0.0.1:{port}", tiny_png()
    samples: list[float] = []
    stop = threading.Event()
    try:
        deadline = time.monotonic() + 3600
        while True:
            try:
                if ready.exists() and httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the index server did not start")
            time.sleep(0.5)
        loaded = json.loads(ready.read_text())
        idle = _status(child.pid)
        with open(f"/proc/{child.pid}/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS: the peak below is the serving window's
        process = psutil.Process(child.pid)

        def sample() -> None:
            while not stop.wait(0.05):
                samples.append(process.memory_info().rss / 2**30)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        form = {"files": {"image": ("q.png", png, "image/png")}, "data": {"k": str(K)}}
        answers, seq = [], []
        with httpx.Client(base_url=url, timeout=120) as c:
            for _ in range(len(queries)):  # request i answers held-out query i (the replay model's order)
                r = c.post("/search", **form)
                r.raise_for_status()
                answers.append([hit["row"] for hit in r.json()["results"]])
            for _ in range(settings["warmup"]):
                c.post("/search", **form).raise_for_status()
            for _ in range(settings["sequential"]):
                start = time.perf_counter()
                r = c.post("/search", **form)
                seq.append((time.perf_counter() - start) * 1000)
                r.raise_for_status()
        stop.set()
        sampler.join()
        end = _status(child.pid)
    finally:
        stop.set()
        child.terminate()
        child.wait(60)
    return {"queries": len(queries), "recall": round(recall_at_k(exact, answers), 4), "load_s": loaded["load_s"],
            "searcher": loaded["type"], "idle_rss_gb": idle["VmRSS"], "idle": idle, "end": end,
            "peak_rss_gb": end["VmHWM"], "sampled_peak_rss_gb": round(max(samples, default=0.0), 3),
            "warmup": settings["warmup"], "http_sequential_ms": summary_ms(seq)}


# ---------------------------------------------------------------------------------------------------------
# Rendering (report.bigindex_section)


def render(data: dict[str, Any]) -> str:
    b, s, g = data["build"], data["serve"], data["generate"]
    seq = s["http_sequential_ms"]
    order = ["train", "fill", "merge", "refine_store", "ids", "exact_truth", "tune_and_recall"]  # as they ran
    phases = ", ".join(f"{name} {b['build_s'][name]} s" for name in sorted(b["build_s"], key=(order + [*b["build_s"]]).index))
    files = ", ".join(f"`{name}` {size} GB" for name, size in b["index_gb"].items())
    return "\n".join([
        f"**{data['rows']} x {DIM}** unit vectors in {g['shards']} parquet shards of up to {g['shard_rows']} rows "
        f"({g['shard_gb']} GB, generated and written in {g['seconds']} s, one shard in memory at a time; "
        f"{g['clusters']} Gaussian clusters, noise {g['noise']} a dimension). Index: IVF{b['nlist']},PQ{b['pq_m']}"
        f"x{b['pq_nbits']} on disk, {b['refine']} store memory-mapped, nprobe {b['nprobe']}, k_factor "
        f"{b['k_factor']} (the smallest of the ladder reaching recall@10 {b['tune_target']} on catalogue rows: "
        + ", ".join(f"{t['k_factor']}: {t['recall']}" for t in b["k_factor_ladder"])
        + f"; the build's own recall@10 on other catalogue rows {b['build_recall']}).", "",
        f"Build: **{b['build_wall_s']} s** ({phases}). Disk: **{b['index_total_gb']} GB** "
        f"in the index folder ({files}); the raw shards took {g['shard_gb']} GB more while building. "
        f"Exact top-10 of {s['queries']} held-out queries streamed over the shards in {data['exact_s']} s.", "",
        "recall@10 at other nprobe (this process, the same queries and k_factor): "
        + ", ".join(f"{c['nprobe']}: {c['recall']} ({c['ms_per_query']} ms a query)" for c in data["nprobe_curve"])
        + ".", "",
        f"Served by `CatalogueIndex.load` in a process of its own (searcher `{s['searcher']}`), loaded in "
        f"{s['load_s']} s (sha256 of every file, then the maps); idle RSS {s['idle_rss_gb']} GB. `/search` "
        f"one request at a time after {s['warmup']} warm-up requests: the HTTP round trip with a tiny PNG whose "
        "embedding the replay model supplies (no network forward pass), the IVF-PQ search, the re-rank from the "
        "mapped store, the id map and the JSON.", "",
        markdown_table(["what", "requests", "p50 ms", "p99 ms", "p99 95% interval", "mean ms"],
                       [["HTTP /search, one at a time", seq["n"], seq["p50"], seq["p99"]["value"],
                         f"[{seq['p99']['low']}, {seq['p99']['high']}]", seq["mean"]]]), "",
        f"Recall@10 of `/search` against exact on the {s['queries']} held-out queries: **{s['recall']}**. Peak "
        f"resident memory of the serving process over those requests and the timed ones: **{s['peak_rss_gb']} "
        f"GB** (VmHWM after a reset once loaded; sampled every 50 ms: {s['sampled_peak_rss_gb']} GB); at the end "
        f"RssAnon {s['end']['RssAnon']} GB, RssFile {s['end']['RssFile']} GB (pages of the mapped lists and "
        "store, released after each re-rank).", ""])


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks bigindex")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--n", type=int, default=None, help="catalogue rows (default 10M; 200 000 with --quick)")
    parser.add_argument("--nprobe", type=int, default=NPROBE)
    parser.add_argument("--workdir", default="/tmp/xbn-bigindex", help="shards and index (deleted at the end)")
    parser.add_argument("--keep", action="store_true", help="keep the index folder in --workdir")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    rows = args.n or settings["rows"]
    name = args.output or ("bigindex_quick" if args.quick and not args.n else "bigindex" if rows == FULL["rows"]
                           else f"bigindex_n{rows}")
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    (work / "shards").mkdir(parents=True)
    clusters = max(1, rows // ROWS_PER_CLUSTER)
    centres = cluster_centres(clusters, SEED)
    sizes = shard_sizes(rows, settings["shard_rows"])
    try:
        print(f"bigindex: generating {rows} rows in {len(sizes)} shards under {work}", flush=True)
        shards, gen_s = write_shards(work / "shards", sizes, centres, SEED)
        generate = {"shards": len(sizes), "shard_rows": settings["shard_rows"], "clusters": clusters,
                    "noise": NOISE, "seconds": round(gen_s, 1),
                    "shard_gb": round(sum(p.stat().st_size for p in shards) / 2**30, 3)}
        queries = clustered_rows(settings["queries"], centres, [SEED, 2])
        print("bigindex: building", flush=True)
        built_info, built = build(shards, work / "index", rows, args.nprobe)
        print(f"bigindex: built in {built_info['build_wall_s']} s {built_info['build_s']}; exact top-10", flush=True)
        start = time.perf_counter()
        exact = exact_top_k(queries, shards)
        exact_s = round(time.perf_counter() - start, 1)
        curve = nprobe_curve(built, queries, exact, args.nprobe)
        del built
        shutil.rmtree(work / "shards")  # only the index folder is served
        print(f"bigindex: nprobe curve {curve}; serving", flush=True)
        served = bench_serve(work / "index", queries, exact, settings)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    import faiss

    data: dict[str, Any] = {"rows": rows, "dim": DIM, "k": K, "settings": settings | {"rows": rows},
                            "generate": generate, "build": built_info, "exact_s": exact_s, "nprobe_curve": curve,
                            "serve": served, "threads": faiss.omp_get_max_threads(),
                            "loadavg_1min": round(os.getloadavg()[0], 2)}
    data["targets"] = targets(data)
    path = write_result(name, data)
    print(render(data))
    for t in data["targets"]:
        print(f"{t['verdict']:>14}  {t['what']}: {t['value']}")
    return path
