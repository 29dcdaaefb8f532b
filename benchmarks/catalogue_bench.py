"""The catalogue flow's embedding on Dask (issue 29), measured against one `xbn embed` process:

- `single_T`: the batch embedding job of `xbn embed` (`xbn.serving.embed_job`) in one process with T torch
  threads, the model loaded (data.num_workers 0: T threads in all);
- `dask_K`: the flow's embedding step (`embed_shards` of xbn/flows/catalogue.py, through prefect-dask's
  DaskTaskRunner) on a LocalCluster of K worker processes of 1 thread each, warm (each worker has loaded the
  registry version once, as it does for the first shard of a run).

Both embed the same glyph catalogue with the registry's champion; the contenders alternate within each round,
the shard files deleted before each Dask run. Images/s = images / wall time of the embedding. Target: `dask_2`
>= 0.9 x `single_2` (the round's ratio; verdict from the interquartile range over rounds). Scaling efficiency
of K workers: dask_K / (K x single_1).

    python -m benchmarks catalogue [--images 4000] [--rounds 5] [--quick] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import machine_info, markdown_table, write_result
from benchmarks.verdicts import interval, verdict

PACKAGES = ("torch", "timm", "dask", "distributed", "prefect", "prefect-dask")
TARGET = 0.9
WORKERS = (1, 2)
# Shards of some seconds of work each: a task's own cost (Prefect's task run, the shard's files) is then small.
FULL = {"images": 4000, "rounds": 5, "backbone": "tf_efficientnet_lite0", "embedding_dim": 512, "image_size": 64,
        "shard_size": 1000}
QUICK = {"images": 480, "rounds": 2, "backbone": "test_efficientnet", "embedding_dim": 16, "image_size": 32,
         "shard_size": 240}


def _project(work: Path, settings: dict[str, Any]):
    """A project in `work`: a glyph catalogue, its manifest, and a registered champion (untrained weights: the
    speed is what is measured); returns its params."""
    import yaml

    from xbn.config import load_params
    from xbn.models import build_embedder, save_embedder
    from xbn.stages.prepare import prepare
    from xbn.stages.register import register
    from xbn.tracking import pipeline_run

    root = work / "glyphs"  # `prepare` generates the glyph set there
    overrides = [f"data.root={root}", "data.dataset=glyphs", f"data.glyphs.classes={settings['images'] // 8}",
                 "data.glyphs.images_per_class=8", "data.glyphs.image_size=32",
                 f"data.image_size={settings['image_size']}",
                 "data.num_workers=0", "data.version=none", f"model.backbone={settings['backbone']}",
                 "model.pretrained=none", f"model.embedding_dim={settings['embedding_dim']}",
                 f"tracking.uri=sqlite:///{work / 'mlflow.db'}", f"catalogue.source={root / 'images'}",
                 f"catalogue.shard_size={settings['shard_size']}", f"catalogue.output={work / 'catalogue'}",
                 "inference.channels_last=false", "inference.precision=float32"]
    params = load_params(Path(__file__).resolve().parent.parent / "params.yaml", overrides)
    (work / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
    prepare(params)
    model, data_config = build_embedder(params.model)
    save_embedder(Path(params.train.checkpoint_dir) / "model.pt", model, params.model, data_config, {"epoch": 0})
    Path(params.eval.output).parent.mkdir(parents=True, exist_ok=True)
    Path(params.eval.output).write_text('{"recall@1": 0.5, "recall@10": 0.8, "map@r": 0.3, "r_precision": 0.3, '
                                        '"nmi": 0.5}')
    with pipeline_run(params, "train", new=True):
        pass
    assert register(params)["alias"] == "champion"
    return params


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small catalogue and a tiny model, 2 rounds")
    parser.add_argument("--images", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--workdir", default=None, help="default: a temp folder, removed at the end")
    args = parser.parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    settings.update({k: v for k, v in (("images", args.images), ("rounds", args.rounds)) if v is not None})
    work = Path(args.workdir or tempfile.mkdtemp(prefix="xbn-catalogue-bench-")).absolute()
    work.mkdir(parents=True, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(work)
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect"))
    os.environ.setdefault("XBN_CPU_BF16", "0")  # one precision for every contender
    try:
        result = measure(settings)
    finally:
        os.chdir(cwd)
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    name = "catalogue_quick" if args.quick else "catalogue"
    path = write_result(name, result)
    print(render(result | {"_file": str(path)})[0])
    print(f"wrote {path}")


def measure(settings: dict[str, Any]) -> dict[str, Any]:
    import torch
    from distributed import LocalCluster
    from prefect.testing.utilities import prefect_test_harness
    from prefect_dask import DaskTaskRunner

    from xbn.flows.catalogue import embed_shards, for_workers
    from xbn.serving.embed_job import embed_rows_to_parquet
    from xbn.serving.sources import read_source
    from xbn.stages.catalogue import plan, worker_model

    params = for_workers(_project(Path.cwd(), settings))
    planned = plan(params)
    model = worker_model(params, planned.version)
    frame, root = read_source(params.catalogue.source)
    images = len(frame)
    threads = max(WORKERS)
    rounds: list[dict[str, Any]] = []
    with prefect_test_harness(server_startup_timeout=120):
        clusters = {k: LocalCluster(n_workers=k, threads_per_worker=1, processes=True, dashboard_address=None)
                    for k in WORKERS}
        try:
            def single(t: int) -> float:
                torch.set_num_threads(t)
                out = Path(f"single-{t}.parquet")
                out.unlink(missing_ok=True)
                start = time.perf_counter()
                embed_rows_to_parquet(model, frame, root, out, chunk_size=params.catalogue.chunk_size,
                                      batch_size=params.index.batch_size, num_workers=0, progress=False)
                return time.perf_counter() - start

            def dask(k: int) -> float:
                for shard in planned.shards:
                    Path(shard.output).unlink(missing_ok=True)
                runner = DaskTaskRunner(address=clusters[k].scheduler_address)
                start = time.perf_counter()
                embed_shards.with_options(task_runner=runner)(params, planned.version, planned.shards)
                return time.perf_counter() - start

            contenders = {**{f"single_{t}": (lambda t=t: single(t)) for t in sorted({1, threads})},
                          **{f"dask_{k}": (lambda k=k: dask(k)) for k in WORKERS}}
            for run in contenders.values():  # warm-up: workers load the model, caches fill
                run()
            for r in range(settings["rounds"]):
                order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
                row: dict[str, Any] = {"order": order, "loadavg_before": [round(v, 2) for v in os.getloadavg()]}
                for name in order:
                    row[name] = round(images / contenders[name](), 1)
                rounds.append(row)
                print(f"round {r + 1}: " + ", ".join(f"{n} {row[n]} images/s" for n in contenders), flush=True)
        finally:
            for cluster in clusters.values():
                cluster.close()
    ratios = [row[f"dask_{threads}"] / row[f"single_{threads}"] for row in rounds]
    spread = interval(ratios)
    efficiency = {str(k): interval([row[f"dask_{k}"] / (k * row["single_1"]) for row in rounds]) for k in WORKERS}
    return {
        "settings": settings | {"threads_total": threads, "chunk_size": params.catalogue.chunk_size,
                                "batch_size": params.index.batch_size},
        "machine": machine_info(PACKAGES),
        "images": images,
        "rounds": rounds,
        "images_per_s": {name: interval([row[name] for row in rounds]) for name in rounds[0] if
                         name.startswith(("single_", "dask_"))},
        "dask_over_single": spread | {"per_round": [round(x, 4) for x in ratios]},
        "scaling_efficiency": efficiency,
        "target_at_least": TARGET,
        "verdict": verdict(spread["p25"], spread["p75"], at_least=TARGET),
    }


def render(data: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The report's section text and its target row."""
    s, threads = data["settings"], data["settings"]["threads_total"]
    rates = data["images_per_s"]
    table = markdown_table(["contender", "images/s median", "p25", "p75"],
                           [[name, v["median"], v["p25"], v["p75"]] for name, v in rates.items()])
    ratio = data["dask_over_single"]
    efficiency = ", ".join(f"{k} worker(s) {v['median']} (IQR {v['p25']}-{v['p75']})"
                           for k, v in data["scaling_efficiency"].items())
    text = (f"{data['images']} glyph images embedded with a registered `{s['backbone']}` at {s['image_size']} px, "
            f"{s['rounds']} round(s) alternating the contenders' order; shards of {s['shard_size']}.\n\n{table}\n\n"
            f"Dask with {threads} workers / one process with {threads} threads: median **{ratio['median']}** (IQR "
            f"{ratio['p25']}-{ratio['p75']}; target >= {data['target_at_least']}). Scaling efficiency (dask_K / "
            f"(K x single_1)): {efficiency}.")
    row = {"section": "catalogue", "what": f"Dask embedding, {threads} workers / one `xbn embed` process with "
           f"{threads} threads, images/s >= {TARGET}", "value": ratio["median"], "verdict": data["verdict"]}
    return text, [row]
