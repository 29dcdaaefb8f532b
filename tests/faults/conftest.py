"""The weekly loop as deployed, for the fault suite: a Prefect server on PostgreSQL behind basic auth (leases on
disk, as compose runs it) and a process worker started by infra/prefect/worker.sh, an MLflow server on the same
PostgreSQL, reached through a proxy that can lose a response, a DVC project with a remote around a folder of real
images, and a real HTTP receiver for the notifications. PostgreSQL is a cluster of this suite's own, so that restarting
it disturbs no other test. One stack for the whole module; each case injects its fault into one tiny run."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from infra.support import LEASE_STORAGE, api, free_port, stop, stop_worker, tail, wait_http
from tests_support import ROOT, TINY, NotificationReceiver

from .support import LosingProxy, PrivatePostgres

DEPLOYMENT = "xbn-retrain/xbn-weekly-retrain"
# Planted secrets (issue 41 item 3): every run of the suite gets them the way the docs say (the environment), and
# none may land in any record: a password in the tracking URI (any character), an S3 secret key, a notifier token,
# the Prefect API's basic auth (compose's PREFECT_API_AUTH_STRING).
PLANTED = "pl4nted" + uuid.uuid4().hex[:12]
PREFECT_AUTH = f"admin:auth{PLANTED}"
ALIVE = ("SCHEDULED", "PENDING", "RUNNING")


@dataclass
class Loop:
    pg: PrivatePostgres
    proxy: LosingProxy
    mlflow_url: str  # the server itself (the flows go through the proxy)
    prefect_url: str
    deployment_id: str
    workdir: Path
    faults: Path  # XBN_FAULT_DIR
    overrides: list[str]
    receiver: NotificationReceiver
    worker: subprocess.Popen
    worker_log: Path
    env: dict  # a client's environment (the worker's)
    home: Path  # the stack's folder: artifacts/, dvc-remote/, the logs
    start_mlflow: object  # () -> None
    stop_mlflow: object  # () -> None
    restart_prefect: object  # () -> float: the seconds the server was down
    timeline: list[dict] = field(default_factory=list)

    def failed(self, message: str) -> str:
        return f"{message}\nworker log:\n{tail(self.worker_log, 8000)}"

    def api(self, path: str, body: dict | None = None, method: str | None = None) -> tuple[int, object]:
        """A call to the Prefect API, with the stack's basic auth."""
        return api(self.prefect_url, path, body, auth=PREFECT_AUTH, method=method)

    def start(self, fault: str | None = None, extra: list[str] = (), force: bool = False,
              env: dict[str, str] | None = None) -> str:
        """A deployment run, as the schedule starts one; `fault`: XBN_FAULT, and `env`, for this run's process.
        A `wait` point starts unreached: a point released once lets every later pass (xbn.utils.faults), and an
        earlier case may have used it."""
        for entry in (fault or "").split(","):
            point, _, action = entry.partition(":")
            if action == "wait":
                for suffix in (".reached", ".release"):
                    (self.faults / f"{point}{suffix}").unlink(missing_ok=True)
        env = {**({"XBN_FAULT": fault, "XBN_FAULT_DIR": str(self.faults)} if fault else {}), **(env or {})}
        status, run = self.api(f"/deployments/{self.deployment_id}/create_flow_run",
                               {"parameters": {"overrides": [*self.overrides, *extra], "force": force},
                                "job_variables": {"env": env}})
        assert status == 201, f"create_flow_run: HTTP {status}"
        return run["id"]

    def state(self, run_id: str) -> dict:
        status, run = self.api(f"/flow_runs/{run_id}")
        assert status == 200, f"flow run {run_id}: HTTP {status}"
        return run

    def finish(self, run_id: str, timeout: float = 420) -> dict:
        deadline = time.monotonic() + timeout
        while (run := self.state(run_id))["state_type"] in ALIVE:
            assert self.worker.poll() is None, self.failed("the worker died")
            assert time.monotonic() < deadline, self.failed(f"run {run_id} did not end within {timeout:.0f} s")
            time.sleep(0.5)
        return run

    def wait_reached(self, point: str, run_id: str, timeout: float = 420) -> float:
        """Wait until the run's process pauses at fault point `point` (XBN_FAULT=<point>:wait)."""
        deadline, reached = time.monotonic() + timeout, self.faults / f"{point}.reached"
        while not reached.exists():
            state = self.state(run_id)["state_type"]
            assert state in ALIVE, self.failed(f"run {run_id} ended {state} before {point}")
            assert time.monotonic() < deadline, self.failed(f"run {run_id} never reached {point}")
            time.sleep(0.3)
        return time.monotonic()

    def release(self, point: str) -> None:
        (self.faults / f"{point}.release").touch()

    def messages_since(self, count: int) -> list[str]:
        return [m.get("title", "") for m in self.receiver.messages[count:]]

    def params(self, extra: tuple[str, ...] = ()):
        from xbn.config import load_params

        with contextlib.chdir(self.workdir):
            params = load_params("params.yaml", [*self.overrides, *extra, f"tracking.uri={self.mlflow_url}"])
        return params


@pytest.fixture(scope="module")
def loop(tmp_path_factory) -> Iterator[Loop]:
    from xbn.data.glyphs import generate_glyphs

    tmp = tmp_path_factory.mktemp("faults")
    pg = PrivatePostgres()
    for database in ("prefect", "mlflow", "locks"):
        pg.create_database(database)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "XBN_"))}
    base |= {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PREFECT_HOME": str(tmp / "home"),
             "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "GX_ANALYTICS_ENABLED": "false",
             "MLFLOW_DISABLE_TELEMETRY": "true",
             "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # as compose: no job runner (its huey consumers)
             # The stack's own cache (in compose, the worker container's), not ~/.cache/xbn of whoever runs the
             # suite: the flows' ONNX graphs and decoded images landed there, a new set every run.
             "XBN_CACHE_DIR": str(tmp / "cache")}

    # MLflow, on the suite's PostgreSQL, artifacts served from a folder (s3:// in compose).
    mlflow_port, mlflow_log = free_port(), tmp / "mlflow.log"
    mlflow_cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", pg.url("mlflow"),
                  "--artifacts-destination", str(tmp / "artifacts"), "--host", "127.0.0.1",
                  "--port", str(mlflow_port), "--workers", "1", "--allowed-hosts", "127.0.0.1,127.0.0.1:*"]
    mlflow_proc: list[subprocess.Popen] = []

    def start_mlflow(wait: bool = True) -> None:
        with mlflow_log.open("a") as out:
            proc = subprocess.Popen(mlflow_cmd, cwd=tmp, env=base, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        mlflow_proc[:] = [proc]
        if wait:
            wait_http(f"http://127.0.0.1:{mlflow_port}/health", proc, mlflow_log, timeout=180)

    def stop_mlflow() -> None:
        stop(mlflow_proc[0])

    # Prefect, on the same PostgreSQL, as compose runs it: the API behind basic auth, the deployment's concurrency
    # leases on disk (PREFECT_HOME), so that a restarted server still knows a running flow's lease (in memory the
    # run crashed: issue 40).
    prefect_port = free_port()
    prefect_url, prefect_log = f"http://127.0.0.1:{prefect_port}/api", tmp / "prefect.log"
    server_env = {**base, "PREFECT_UI_ENABLED": "false", "PREFECT_SERVER_API_AUTH_STRING": PREFECT_AUTH,
                  "PREFECT_API_DATABASE_CONNECTION_URL": pg.url("prefect", "postgresql+asyncpg"),
                  "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": LEASE_STORAGE}
    prefect_proc: list[subprocess.Popen] = []

    def start_prefect(wait: bool = True) -> None:
        with prefect_log.open("a") as out:
            proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                     "--port", str(prefect_port)], cwd=tmp, env=server_env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        prefect_proc[:] = [proc]
        if wait:  # the health probe needs no auth, as in compose
            wait_http(f"{prefect_url}/health", proc, prefect_log, timeout=180)

    def restart_prefect() -> float:
        """SIGTERM (as `docker restart` sends), then start it again: the seconds it was down."""
        began = time.monotonic()
        stop(prefect_proc[0])
        start_prefect()
        return time.monotonic() - began

    proxy = receiver = worker = None
    try:
        start_mlflow(wait=False)  # the two servers start side by side (each mostly waits on its migrations)
        start_prefect(wait=False)
        wait_http(f"http://127.0.0.1:{mlflow_port}/health", mlflow_proc[0], mlflow_log, timeout=180)
        wait_http(f"{prefect_url}/health", prefect_proc[0], prefect_log, timeout=180)
        proxy = LosingProxy(mlflow_port)
        receiver = NotificationReceiver()

        # The project: prefect.yaml, params.yaml, the flows' entry points, a DVC project with a remote, images.
        workdir = tmp / "app"
        workdir.mkdir()
        shutil.copy(ROOT / "prefect.yaml", workdir)
        shutil.copy(ROOT / "params.yaml", workdir)
        shutil.copytree(ROOT / "pipelines", workdir / "pipelines", ignore=shutil.ignore_patterns("__pycache__"))
        generated = generate_glyphs(tmp / "glyphs", classes=24, images_per_class=4, image_size=32, seed=0)
        shutil.copytree(generated / "images", workdir / "data" / "catalogue")
        for args in (["init", "--no-scm", "-q"], ["remote", "add", "-d", "store", str(tmp / "dvc-remote")]):
            subprocess.run([sys.executable, "-m", "dvc", *args], cwd=workdir, env=base, check=True,
                           capture_output=True)
        replaced = ("data.version", "tracking.enabled", "train.epochs", "train.warmup_epochs")
        overrides = [o for o in TINY if not o.startswith(replaced)]
        overrides += ["train.epochs=1", "train.warmup_epochs=0", "train.finetune_epochs=1", "data.dataset=folder",
                      "data.root=data/catalogue", "data.version=dvc", "tracking.enabled=true",
                      f"tracking.lock_uri={pg.url('locks')}", "tracking.outage_s=90",
                      "drift.sample=32", "drift.permutations=99",
                      # A promoted model serves the whole catalogue, indexed by the catalogue flow on Dask.
                      "catalogue.source=data/catalogue", "catalogue.workers=1"]
        faults = tmp / "faults"
        faults.mkdir()
        # The store through the proxy, as the pipeline's account with a password that needs every escape.
        password = urllib.parse.quote(f"p@ss/w0rd@{PLANTED}", safe="")
        env = {**base, "PREFECT_API_URL": prefect_url, "PREFECT_API_AUTH_STRING": PREFECT_AUTH,
               "XBN_WORKDIR": str(workdir), "PREFECT_WORKER_QUERY_SECONDS": "1",
               "MLFLOW_TRACKING_URI": f"http://xbn-pipeline:{password}@127.0.0.1:{proxy.port}",
               "AWS_SECRET_ACCESS_KEY": f"aws{PLANTED}",
               "XBN_NOTIFY_URLS": receiver.url.replace("json://", f"json://notify:tok{PLANTED}@")}
        worker_log = tmp / "worker.log"
        with worker_log.open("w") as out:  # the compose service's entry point: pool, deploy, then the worker
            worker = subprocess.Popen(["bash", str(ROOT / "infra/prefect/worker.sh")], cwd=tmp, env=env,
                                      stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 240
        while not (found := api(prefect_url, "/deployments/filter", {}, auth=PREFECT_AUTH)[1]):
            assert worker.poll() is None and time.monotonic() < deadline, tail(worker_log)
            time.sleep(1)
        yield Loop(pg, proxy, f"http://127.0.0.1:{mlflow_port}", prefect_url, found[0]["id"], workdir, faults,
                   overrides, receiver, worker, worker_log, env, tmp, start_mlflow, stop_mlflow, restart_prefect)
    finally:  # nothing is asserted of the stack's own shutdown: 1 s of grace, then SIGKILL
        if worker is not None:
            stop_worker(worker, grace=1)
        for proc in [*prefect_proc, *mlflow_proc]:
            stop(proc, grace=1)
        if proxy is not None:
            proxy.close()
        if receiver is not None:
            receiver.close()
        pg.close()


def record(loop: Loop, case: str, **row) -> None:
    """One row of the suite's timeline (printed at the end, and written to $XBN_FAULT_TIMELINE if set)."""
    loop.timeline.append({"case": case, **row})
    if path := os.environ.get("XBN_FAULT_TIMELINE"):
        Path(path).write_text(json.dumps(loop.timeline, indent=1))
    print(json.dumps({"case": case, **row}))
