"""The catalogue flow `xbn-catalogue`: the whole catalogue re-embedded with a registry version (the champion by
default) on a Dask cluster, indexed, and the index attached to that version (`xbn.stages.catalogue`).

    plan (here) -> embed_shard x N (Dask workers, through prefect-dask's DaskTaskRunner) -> publish (here)

The cluster: the `--address` given, else `$DASK_SCHEDULER_ADDRESS`, else `catalogue.scheduler_address`; with
none, a LocalCluster of this machine's cores (`catalogue.workers` processes of `catalogue.threads_per_worker`
torch threads). Workers need this project importable (`pip install` it, or PYTHONPATH) and `catalogue.output`
at the same path (a shared filesystem); they load the model from the registry themselves.

A worker that dies mid-shard (a lost machine, SIGKILL) loses at most the chunk it was writing: Dask gives the
shard to another worker, which resumes it from its finished chunks. A shard a task finished is never redone,
not by a re-run of the flow either; when every shard is done and the version already serves their index, a
run does nothing. The retrain flow runs this flow after it promotes a champion (`catalogue.on_promotion`).

    xbn catalogue                                          # the champion, on a LocalCluster
    xbn catalogue --address tcp://10.0.0.5:8786            # on a running cluster (dask scheduler / dask worker)
    python -m xbn.flows.catalogue --model-version 7
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task, unmapped
from prefect.artifacts import create_markdown_artifact
from prefect.futures import as_completed

from xbn.config import ConfigError, Params, load_params
from xbn.flows.tasks import TASK_OPTIONS
from xbn.stages.catalogue import CataloguePlan, Shard, plan, publish
from xbn.stages.catalogue import embed_shard as embed
from xbn.utils.secrets import masks_exceptions

SCHEDULER_ENV = "DASK_SCHEDULER_ADDRESS"


def scheduler_address(params: Params, address: str | None = None) -> str | None:
    """The Dask scheduler to use: `address`, else $DASK_SCHEDULER_ADDRESS, else `catalogue.scheduler_address`
    (the environment wins over the file, as MLFLOW_TRACKING_URI does); None: a LocalCluster."""
    return address or os.environ.get(SCHEDULER_ENV) or params.catalogue.scheduler_address


def task_runner(params: Params, address: str | None = None):
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError:
        raise ConfigError("the catalogue flow runs on Dask: pip install 'xbn[dask]' (dask, distributed, "
                          "prefect-dask)") from None

    found = scheduler_address(params, address)
    if found:
        return DaskTaskRunner(address=found)
    threads = params.catalogue.threads_per_worker
    workers = params.catalogue.workers or max(1, (os.cpu_count() or 1) // threads)
    # One shard at a time per worker process; the task sets its torch threads.
    return DaskTaskRunner(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True,
                                          "dashboard_address": None})


def for_workers(params: Params) -> Params:
    """`params` with the tracking store the flow resolved ($MLFLOW_TRACKING_URI or tracking.uri; a relative
    SQLite path made absolute), so workers that lack the flow's environment load from the same registry; without
    the URI's user and password: the params travel as a subflow's parameters, which Prefect stores and shows.
    A worker authenticates with its own account (MLFLOW_TRACKING_USERNAME/PASSWORD, READ is enough); workers of
    the flow's own LocalCluster inherit the flow's environment."""
    from urllib.parse import urlsplit, urlunsplit

    from xbn.tracking import tracking_uri

    uri = tracking_uri(params)
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = f"sqlite:///{Path(uri.removeprefix('sqlite:///')).absolute()}"
    parts = urlsplit(uri)
    if parts.password is not None or parts.username is not None:
        uri = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    return params.model_copy(update={"tracking": params.tracking.model_copy(update={"uri": uri})})


@task(**TASK_OPTIONS)
@masks_exceptions
def plan_catalogue(params: Params, version: int | None) -> CataloguePlan:
    return plan(params, version)


@task(**TASK_OPTIONS)
@masks_exceptions
def embed_shard(params: Params, version: int, shard: Shard) -> dict:
    report = embed(params, version, shard)
    try:
        from distributed import get_worker

        report["worker"] = get_worker().address
    except ValueError:  # not on a Dask worker (a test calling .fn)
        report["worker"] = None
    return report


@task(**TASK_OPTIONS)
@masks_exceptions
def publish_index(params: Params, planned: CataloguePlan) -> dict:
    return publish(params, planned)


@flow(name="xbn-catalogue-embed")
@masks_exceptions
def embed_shards(params_path: str, overrides: list[str], version: int, shards: list[Shard]) -> list[dict]:
    """The shards mapped over the flow's Dask cluster (the caller picks it: `with_options(task_runner=...)`).
    It takes the params' file and overrides, not the resolved params: Prefect records a flow run's parameters,
    and a password in a resolved URI must not land there (the tasks' inputs are not recorded)."""
    logger = get_run_logger()
    params = for_workers(load_params(params_path, list(overrides)))
    done, start = [], time.time()
    for future in as_completed(embed_shard.map(unmapped(params), unmapped(version), shards)):
        report = future.result()
        done.append(report)
        logger.info("shard %d: %d row(s) on %s in %.1f s (%d chunk(s) resumed); %d/%d done at +%.1f s",
                    report["shard"], report["rows"], report["worker"] or report["pid"],
                    report["finished"] - report["started"], report.get("chunks_resumed", 0), len(done),
                    len(shards), time.time() - start)
    return sorted(done, key=lambda r: r["shard"])


@flow(name="xbn-catalogue", log_prints=True)
@masks_exceptions
def catalogue(params_path: str = "params.yaml", overrides: list[str] | None = None, version: int | None = None,
              address: str | None = None) -> dict:
    """Embed `catalogue.source` with registry version `version` (None: the one holding `serve.alias`) on the
    Dask cluster at `address` (see the module docstring), index it and attach the index to the version."""
    logger = get_run_logger()
    params = for_workers(load_params(params_path, list(overrides or [])))
    planned = plan_catalogue(params, version)
    todo = planned.todo()
    report: dict[str, Any] = {
        "version": planned.version, "model_sha256": planned.model_sha256, "fingerprint": planned.fingerprint,
        "rows": planned.rows, "shards": len(planned.shards),
        "shards_done_before": len(planned.shards) - len(todo), "embedded": [], "index": None,
        "up_to_date": False}
    if todo:
        runner = task_runner(params, address)
        logger.info("embedding %d shard(s) on %s", len(todo), scheduler_address(params, address) or "a LocalCluster")
        report["embedded"] = embed_shards.with_options(task_runner=runner)(params_path, list(overrides or []),
                                                                           planned.version, todo)
    elif planned.up_to_date:
        logger.info("catalogue: v%d already serves the index of these %d image(s): nothing to do",
                    planned.version, planned.rows)
        report["up_to_date"] = True
        return report
    report["index"] = publish_index(params, planned)
    index = report["index"]
    create_markdown_artifact(
        key="xbn-catalogue", description="the catalogue index attached to the version",
        markdown=f"# xbn catalogue: v{planned.version}\n\n{planned.rows} image(s) in {len(planned.shards)} "
                 f"shard(s), {len(todo)} embedded now; {index['type']}{' (on disk)' if index['ondisk'] else ''} "
                 f"index of {index['count']}, recall@10 {index['recall@10']:.4f}, {index['skipped']} unreadable.")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--model-version", type=int, default=None)
    parser.add_argument("--address", default=None, help="Dask scheduler (default: $DASK_SCHEDULER_ADDRESS)")
    args = parser.parse_args(argv)
    catalogue(args.params, args.overrides, args.model_version, args.address)


if __name__ == "__main__":
    main()
