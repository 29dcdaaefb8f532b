"""The catalogue flow `xbn-catalogue` on a real Dask cluster: `dask scheduler` and two `dask worker` processes on
127.0.0.1, a registry (SQLite MLflow store) with a champion, a folder of a few thousand glyph images. One worker
is SIGKILLed in the middle of a shard; the flow still completes, the index holds every image once with the
vectors single-process `xbn embed` gives, and a second run embeds nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from tests_support import ROOT, free_port

pytestmark = pytest.mark.slow

IMAGES = (50, 40)  # glyph classes x images per class: 2000 images
OVERRIDES = ["catalogue.shard_size=250", "catalogue.chunk_size=50", "inference.channels_last=false"]


@pytest.fixture(scope="module")
def glyph_images(tmp_path_factory) -> Path:
    from xbn.data.glyphs import generate_glyphs

    root = generate_glyphs(tmp_path_factory.mktemp("catalogue") / "glyphs", classes=IMAGES[0],
                           images_per_class=IMAGES[1], image_size=32, seed=0)
    return root / "images"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A scheduler and two workers, real processes (no nanny: a killed worker stays dead) importing this
    checkout's code, started first so that they come up while the rest is set up; stopped (their logs shown)
    at the end. Yields the scheduler's address, the processes, and a function waiting for the workers that
    returns {pid: worker address} for the workers still alive (a test may have killed one)."""
    from distributed import Client

    where = tmp_path_factory.mktemp("dask")
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
           "MLFLOW_DISABLE_TELEMETRY": "true", "XBN_CPU_BF16": "0"}
    env.pop("MLFLOW_TRACKING_URI", None)  # the flow passes the store it resolved
    processes: dict[str, subprocess.Popen] = {}

    def start(name: str, *argv: str) -> None:
        with open(where / f"{name}.log", "w") as log:
            processes[name] = subprocess.Popen([sys.executable, "-m", *argv], env=env, cwd=where, stdout=log,
                                               stderr=subprocess.STDOUT)

    start("scheduler", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port),
          "--no-dashboard")
    for i in range(2):  # the flow's and the model's imports preloaded: the first shard does not wait on them
        start(f"worker{i}", "distributed.cli.dask_worker", address, "--host", "127.0.0.1", "--nthreads", "1",
              "--no-nanny", "--no-dashboard", "--name", f"worker{i}", "--local-directory", str(where),
              "--preload", "xbn.flows.catalogue", "--preload", "xbn.serving.model")

    def workers() -> dict[int, str]:
        with Client(address, timeout=60) as client:
            alive = sum(p.poll() is None for name, p in processes.items() if name.startswith("worker"))
            client.wait_for_workers(alive, timeout=90)
            return {pid: addr for addr, pid in client.run(os.getpid).items()}

    try:
        yield address, processes, workers
    finally:
        for name, process in processes.items():
            if process.poll() is None:  # the workers' state is thrown away: no graceful close to wait for
                process.terminate() if name == "scheduler" else process.kill()
        for process in processes.values():
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for log in sorted(where.glob("*.log")):
            print(f"----- {log.name}\n{log.read_text()[-3000:]}")


def registered_project(tmp_path: Path, monkeypatch, source: str):
    """tmp_path as a project: params.yaml with the catalogue `source`, a fresh store holding a promoted
    champion (a tiny real model); returns the params."""
    from tracking.helpers import run_pipeline, write_manifest

    from xbn.config import load_params
    from xbn.stages.index import index
    from xbn.tracking import PARENT_RUN_ENV

    monkeypatch.chdir(tmp_path)
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID",
                PARENT_RUN_ENV, "DASK_SCHEDULER_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("USER", "tester")
    write_manifest(tmp_path / "data/manifest.csv", "v1")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["data"].update(root="data/images", image_size=32, num_workers=0)
    params["model"].update(backbone="test_resnet", pretrained="none", embedding_dim=8)
    params["tracking"]["uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"  # absolute: MLflow caches stores by URI
    params["catalogue"]["source"] = source
    Path("params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    loaded = load_params("params.yaml", OVERRIDES)
    assert run_pipeline(loaded, seed=0)["registration"] == "awaiting_index"
    assert index(loaded)["champion"]  # promote last: champion with its gallery's index, before any catalogue
    return loaded


@pytest.fixture
def champion(tmp_path, monkeypatch, glyph_images):
    return registered_project(tmp_path, monkeypatch, str(glyph_images))


def kill_mid_shard(embeddings: Path, pids: dict, timeline: dict, stop: threading.Event) -> None:
    """Wait until a shard is in progress with at least one chunk written, then SIGKILL the worker on it."""
    while not stop.is_set():
        for running in embeddings.glob("*/*.parquet.running"):
            parts = running.parent / f".{running.name.removesuffix('.running')}.parts"
            try:
                holder = json.loads(running.read_text())
            except (OSError, ValueError):
                continue
            if holder["pid"] in pids and len(list(parts.glob("chunk-*.parquet"))) >= 1:
                os.kill(holder["pid"], signal.SIGKILL)
                timeline.update(kill=time.time(), killed_pid=holder["pid"], killed_worker=pids[holder["pid"]],
                                killed_shard=int(running.name.split("-")[1]),
                                chunks_before_kill=len(list(parts.glob("chunk-*.parquet"))))
                return
        time.sleep(0.01)


def test_a_worker_killed_mid_shard_costs_only_its_progress(cluster, prefect_harness, glyph_images, champion,
                                                           tmp_path):
    from xbn.cli import main
    from xbn.flows.catalogue import catalogue
    from xbn.serving.embed_job import read_embeddings
    from xbn.serving.index import CatalogueIndex, unit_rows
    from xbn.serving.sources import read_source
    from xbn.stages.serve import load
    from xbn.tracking import Registry
    from xbn.tracking.registry import CATALOGUE_TAG, INDEX_SHA_TAG

    address, processes, workers = cluster
    pids = workers()
    timeline: dict = {}
    stop = threading.Event()
    killer = threading.Thread(target=kill_mid_shard, args=(tmp_path / "catalogue/embeddings", pids, timeline, stop))
    killer.start()
    timeline["start"] = time.time()
    try:
        report = catalogue("params.yaml", OVERRIDES, address=address)
    finally:
        stop.set()
        killer.join()
    timeline["completion"] = time.time()

    assert "kill" in timeline, "no shard was seen in progress: nothing was killed"
    killed = next(p for p in processes.values() if p.pid == timeline["killed_pid"])
    assert killed.wait(10) == -signal.SIGKILL
    shards = report["embedded"]
    assert [r["shard"] for r in shards] == list(range(8)) and report["shards_done_before"] == 0
    # The killed worker's shard was finished by the other worker, from the chunks it had written.
    redone = next(r for r in shards if r["shard"] == timeline["killed_shard"])
    assert redone["worker"] != timeline["killed_worker"] and redone["chunks_resumed"] >= 1
    assert redone["started"] > timeline["kill"]
    timeline["reschedule"] = redone["started"]
    print("timeline (s from start):", {k: round(v - timeline["start"], 2) for k, v in timeline.items()
                                       if k in ("kill", "reschedule", "completion")},
          {k: v for k, v in timeline.items() if k.startswith(("killed", "chunks"))})

    # Every image exactly once, attached to the champion and served from there.
    frame, _ = read_source(glyph_images)
    index = CatalogueIndex.load(report["index"]["path"])
    assert sorted(index.ids["path"]) == sorted(frame["path"]) and index.ids["path"].is_unique
    assert index.count == len(frame) == 2000 and report["index"]["skipped"] == 0
    version = Registry(champion).get(report["version"])
    assert version.tags[INDEX_SHA_TAG] == report["index"]["index_sha256"]
    assert version.tags[CATALOGUE_TAG] == f"{report['fingerprint']}:{report['index']['index_sha256']}"
    assert load(champion).index.count == 2000  # what `xbn serve` / `xbn search` load now
    assert (tmp_path / "catalogue/index").resolve() == Path(report["index"]["path"])

    # The vectors single-process `xbn embed` gives with the same (champion) model.
    assert main(["embed", "--input", str(glyph_images), "--output", "single.parquet", "--params", "params.yaml",
                 "-q", *(f"--set={o}" for o in OVERRIDES)]) == 0
    single, embeddings = read_embeddings("single.parquet")
    expected = unit_rows(embeddings, "embeddings")[
        single.reset_index().set_index("path").loc[index.ids["path"], "index"].to_numpy()]
    assert np.abs(index.index.reconstruct_n(0, index.count) - expected).max() <= 1e-5

    # A second run: every shard is done and the version serves their index, so nothing is embedded or rebuilt.
    files = {p: p.stat().st_mtime_ns for p in (tmp_path / "catalogue").rglob("*.parquet")}
    again = catalogue("params.yaml", OVERRIDES, address=address)
    assert again["embedded"] == [] and again["up_to_date"] and again["shards_done_before"] == 8
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "catalogue").rglob("*.parquet")} == files


def test_xbn_runs_repair_gives_a_catalogue_champion_its_catalogue_back(cluster, prefect_harness, champion,
                                                                      monkeypatch):
    """Issue 54 item 7: a champion that serves the whole catalogue lost its index (the tag no longer names its
    bytes). `xbn run`'s repair, before its plan, re-indexes the catalogue as the retrain flow's repair does;
    it indexed the dataset's gallery instead, and the champion then served a fraction of the catalogue."""
    from argparse import Namespace

    from xbn.cli import _repair
    from xbn.stages.index import champion_index_problem
    from xbn.stages.serve import load
    from xbn.tracking import Registry
    from xbn.tracking.registry import INDEX_SHA_TAG

    address, _, workers = cluster
    workers()
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", address)
    gallery = load(champion).index.count
    Registry(champion).set_tags(1, {INDEX_SHA_TAG: "0" * 64})
    assert champion_index_problem(champion)["version"] == 1
    _repair(champion, Namespace(params="params.yaml", overrides=OVERRIDES))
    assert champion_index_problem(champion) is None
    assert load(champion).index.count == 2000 != gallery  # the catalogue's images, not the gallery's


def test_a_remote_parquet_catalogue_goes_live_on_disk_and_serving_follows_it(tmp_path, monkeypatch, glyph_root):
    """The stage's steps without a cluster: a parquet of paths at an fsspec URL (the in-memory filesystem,
    standing in for s3://) whose vectors exceed the memory budget, so the index is faiss's on-disk IVF; a
    server already serving the version's previous index switches to it when, and only when, it is attached."""
    import fsspec
    import pandas as pd

    from xbn.serving.http import Holder
    from xbn.serving.index import CatalogueIndex
    from xbn.stages.catalogue import embed_shard, plan, publish
    from xbn.stages.serve import model_source

    images = sorted(p.relative_to(glyph_root).as_posix() for p in glyph_root.rglob("*.png"))
    fs = fsspec.filesystem("memory")
    for rel in images:
        fs.pipe(f"/shop/{rel}", (glyph_root / rel).read_bytes())
    params = registered_project(tmp_path, monkeypatch, "memory://shop/catalogue.parquet")
    first, second = images[:40], images
    fs.pipe("/shop/catalogue.parquet", pd.DataFrame({"path": first}).to_parquet())

    def run(budget_gb: float) -> dict:
        cfg = params.catalogue.model_copy(update={"memory_budget_gb": budget_gb, "ondisk_type": "ivf_flat"})
        current = params.model_copy(update={"catalogue": cfg})
        planned = plan(current)
        reports = [embed_shard(current, planned.version, shard) for shard in planned.todo()]
        assert all(r["embedded"] for r in reports)
        return publish(current, planned)

    holder = Holder(model_source(params))
    assert holder.refresh() and holder.current.index.count == 2  # the champion serves its gallery's index
    assert run(4.0)["count"] == 40 and holder.refresh()
    assert holder.current.index.count == 40 and not holder.current.index.meta.get("ondisk")
    assert not holder.refresh()  # nothing new attached

    fs.pipe("/shop/catalogue.parquet", pd.DataFrame({"path": second}).to_parquet())  # the catalogue grew
    index = run(1e-9)  # its vectors do not fit: on-disk IVF
    assert index["ondisk"] and index["count"] == len(images) and index["recall@10"] == 1.0
    assert holder.refresh() and holder.current.version == "1"  # same version, new index: served now
    served = holder.current.index
    assert served.meta["ondisk"] and sorted(served.ids["path"]) == images
    assert CatalogueIndex.load(tmp_path / "catalogue/index").meta["catalogue"]["rows"] == len(images)
    assert len(list((tmp_path / "catalogue/indexes").iterdir())) == 1  # the previous index folder is gone

    # Issue 54 item 6: an index built earlier is re-used only if its files are the ones its index.json lists.
    victim = next(p for p in Path(index["path"]).iterdir() if p.name != "index.json")
    victim.unlink()  # a new file, not the served one rewritten: the holder has it memory-mapped
    victim.write_bytes(b"not the index")
    assert run(1e-9)["path"] == index["path"]
    assert CatalogueIndex.load(tmp_path / "catalogue/index").count == len(images)  # every file verified


def test_the_command_fails_in_one_line_before_prefect_starts(tmp_path, monkeypatch, capsys):
    """No catalogue configured, no registry, no champion: exit 2 or 1 naming the cause, no flow run."""
    from xbn.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shipped = ["--params", str(ROOT / "params.yaml"), f"--set=tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
    assert main(["catalogue", *shipped]) == 2
    assert capsys.readouterr().err.strip().endswith("catalogue.source is not set: name a folder, a CSV or a "
                                                    "parquet of image paths (local or s3://...)")
    source = f"--set=catalogue.source={tmp_path}"
    assert main(["catalogue", *shipped, source, "--set=tracking.enabled=false"]) == 2
    assert "tracking.enabled must be true" in capsys.readouterr().err
    assert main(["catalogue", *shipped, source]) == 1
    assert "has no version with alias 'champion'" in capsys.readouterr().err
    assert not (tmp_path / "catalogue").exists()
