"""Issue 40: the weekly loop under faults, with real processes. Each case injects one fault into one deployment
run (a named fault point, xbn/utils/faults.py: kill, or wait while the test cuts a server), then lets the next
scheduled run go, and checks what a person on call would: the run completed; exactly one version per model
sha256, every registration finished; the champion's index verified and a freshly started server answering
/health and a search; aliases, decision tags and the champion history agreeing; the notifications that arrived.
The cases build on each other's registry, so they run in order, one test each, on one module-scoped stack
(`make test`'s `--dist loadfile` keeps a module on one worker: tests/architecture/test_suite_grouping.py)."""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.support import api
from tests_support import digests

from .conftest import DEPLOYMENT, PLANTED, Loop, record

pytestmark = pytest.mark.slow


def assert_healthy(loop: Loop, extra: tuple[str, ...] = (), indexed: int = 96) -> dict:
    """The loop's invariants after a fault and the run that followed it, for the model the overrides plus `extra`
    name; returns the versions and aliases. A registration ends done, or abandoned (held, never champion). The
    champion serves `indexed` images: the whole catalogue (24 classes x 4 images) unless a case changed it."""
    from mlflow import MlflowClient

    from serving.serving_support import running
    from xbn.stages.serve import serving_app
    from xbn.tracking import Registry
    from xbn.tracking.history import read_history
    from xbn.tracking.registry import SHA_TAG

    params = loop.params(extra)
    client = MlflowClient(loop.mlflow_url)
    name = params.registry.model_name
    versions = sorted(client.search_model_versions(f"name='{name}'"), key=lambda v: int(v.version))
    shas = collections.Counter(v.tags[SHA_TAG] for v in versions)
    assert all(n == 1 for n in shas.values()), f"a model registered twice: {shas}"
    unfinished = {v.version: v.tags.get("registration") for v in versions
                  if v.tags.get("registration") not in ("done", "abandoned")}
    assert not unfinished, f"registrations left unfinished: {unfinished}"
    registry = Registry(params)
    champion = registry.by_alias("champion")
    assert champion is not None, "no champion"
    assert registry.index_problem(champion) is None, f"champion v{champion.version}: {registry.index_problem(champion)}"
    history = read_history(registry)
    assert history and history[-1].to_version == int(champion.version), [h.line() for h in history]
    promoted = {int(v.version) for v in versions if v.tags.get("decision") == "promoted"}
    assert promoted <= {h.to_version for h in history}, f"promoted but never champion: {promoted}"
    with running(serving_app(params, token=None)) as server:  # what a freshly started `xbn serve` loads
        health = server.get("/health")
        assert health.status_code == 200 and str(health.json()["version"]) == str(champion.version), health.text
        assert health.json()["index_size"] == indexed, health.text
        image = next((loop.workdir / "data" / "catalogue").rglob("*.png")).read_bytes()
        found = server.post("/search", files={"image": ("q.png", image)}, data={"k": "3"})
        assert found.status_code == 200 and len(found.json()["results"]) == 3, found.text
    return {"versions": {int(v.version): v.tags.get("decision") for v in versions},
            "champion": int(champion.version),
            "challenger": getattr(registry.by_alias("challenger"), "version", None)}


def announced(loop: Loop, faulted: dict, sent: int) -> float:
    """Wait for the crash's own notification: Prefect's worker runs the flow's on_crashed hook once it has seen
    the flow's process die. Returns when it arrived."""
    deadline = time.monotonic() + 90
    while not any(t == f"xbn retrain CRASHED: {faulted['name']}" for t in loop.messages_since(sent)):
        assert time.monotonic() < deadline, loop.failed(f"no CRASHED notification: {loop.messages_since(sent)}")
        time.sleep(0.3)
    return time.monotonic()


def run_after(loop: Loop, case: str, began: float, faulted: dict, sent: int, extra: tuple[str, ...] = (),
              **row) -> dict:
    """The next scheduled run after a fault (for the model the overrides plus `extra` name): it completes, and
    the loop is healthy."""
    detected = time.monotonic()
    if faulted.get("state_type") == "CRASHED":
        row["announced_s"] = round(announced(loop, faulted, sent) - began, 1)
    run = loop.finish(loop.start(None, list(extra)))
    assert run["state_type"] == "COMPLETED", loop.failed(f"{case}: the next run ended {run['state_type']}")
    checked = time.monotonic()
    state = assert_healthy(loop, extra)
    record(loop, case, faulted_run=faulted["state_name"], start_to_detected_s=round(detected - began, 1),
           next_run_s=round(run["total_run_time"], 1), health_check_s=round(time.monotonic() - checked, 1),
           **state, notifications=loop.messages_since(sent), **row)
    return state


def case_killed_after_the_champion_alias_moved(loop: Loop) -> None:
    """The first run (no champion yet: the gate promotes) indexes the whole catalogue for v1 (the catalogue flow,
    its shards embedded on a Dask LocalCluster), and is SIGKILLed when the catalogue flow has attached v1's
    index and moved `champion` (promote last), before the history and the model card: Prefect's worker marks
    the run CRASHED and runs its on_crashed hook (a notification), and the next run completes v1's registration
    without training."""
    sent, began = len(loop.receiver.messages), time.monotonic()
    faulted = loop.finish(loop.start("register.after_champion:kill"))
    assert faulted["state_type"] == "CRASHED", loop.failed(f"ended {faulted['state_type']}")
    state = run_after(loop, "SIGKILL after the champion alias moved", began, faulted, sent)
    assert state["versions"] == {1: "promoted"} and state["champion"] == 1
    assert loop.messages_since(sent) == [f"xbn retrain CRASHED: {faulted['name']}", "xbn: v1 registration completed"]
    cache = loop.home / "cache"
    assert cache.is_dir() and any(cache.iterdir()), "the flows did not use the stack's XBN_CACHE_DIR"


def case_killed_after_training(loop: Loop) -> None:
    """A forced run SIGKILLed right after training: nothing was registered, and the next scheduled run (not
    forced) finds nothing changed since v1 and completes in seconds."""
    sent, began = len(loop.receiver.messages), time.monotonic()
    faulted = loop.finish(loop.start("retrain.after_train:kill", ["train.seed=2"], force=True))
    assert faulted["state_type"] == "CRASHED", loop.failed(f"ended {faulted['state_type']}")
    state = run_after(loop, "SIGKILL after train", began, faulted, sent)
    assert state["versions"] == {1: "promoted"} and state["champion"] == 1
    assert loop.messages_since(sent) == [f"xbn retrain CRASHED: {faulted['name']}"]  # nothing to repair


def case_killed_after_create(loop: Loop) -> None:
    """SIGKILL right after `model-versions/create` (v2 exists, tagged `registration: created`): the next run
    completes v2's registration (held or promoted, as its gate decided), and trains nothing."""
    sent, began = len(loop.receiver.messages), time.monotonic()
    faulted = loop.finish(loop.start("register.after_create:kill", ["train.seed=3"], force=True))
    assert faulted["state_type"] == "CRASHED", loop.failed(f"ended {faulted['state_type']}")
    state = run_after(loop, "SIGKILL after create", began, faulted, sent)
    assert sorted(state["versions"]) == [1, 2]
    assert loop.messages_since(sent) == [f"xbn retrain CRASHED: {faulted['name']}", "xbn: v2 registration completed"]


def case_postgres_restarted_mid_flow_while_xbn_retrain_is_refused(loop: Loop) -> None:
    """While a deployment run trains: `xbn retrain` started beside it refuses to run (one line, exit 1), then
    PostgreSQL (Prefect's, MLflow's and the run lock's database) restarts with `pg_ctl restart -m fast`. The
    run carries on and completes."""
    sent, began = len(loop.receiver.messages), time.monotonic()
    run_id = loop.start("retrain.after_train:wait", ["train.seed=4"], force=True)
    loop.wait_reached("retrain.after_train", run_id)
    beside = subprocess.run([sys.executable, "-m", "xbn.cli", "retrain", "--params", "params.yaml",
                             *(f"--set={o}" for o in loop.overrides), "--force"], cwd=loop.workdir,
                            env={**loop.env, "PREFECT_API_URL": loop.prefect_url}, capture_output=True, text=True,
                            timeout=300)
    assert beside.returncode == 1, beside.stdout[-3000:] + beside.stderr[-3000:]
    refused = beside.stderr.strip().splitlines()[-1]
    assert refused.startswith("xbn retrain: another run on") and "did not start" in refused, beside.stderr[-3000:]
    down = loop.pg.restart()
    loop.release("retrain.after_train")
    faulted = loop.finish(run_id)
    assert faulted["state_type"] == "COMPLETED", loop.failed(f"after a PostgreSQL restart: {faulted['state_type']}")
    state = run_after(loop, "xbn retrain beside a run; pg_ctl restart -m fast mid-flow", began, faulted, sent,
                      pg_down_s=round(down, 1), refused=refused[:160])
    assert sorted(state["versions"]) == [1, 2, 3]
    # The refused `xbn retrain` is a flow run that failed on the run lock: its own hook says it was refused (not
    # that the pipeline failed), then the run's own verdict.
    titles = loop.messages_since(sent)
    assert len(titles) == 2 and titles[0].startswith("xbn retrain REFUSED") and titles[1].startswith("xbn: v3 ")


def case_mlflow_down_mid_register_and_a_lost_create_response(loop: Loop) -> None:
    """The MLflow server stops as the run reaches register and is started again 5 s later (down for as long as it
    takes to start, too); then the proxy loses the response to `model-versions/create` (the server registered
    it). The run waits out the outage (tracking.outage_s), finds its version instead of creating a second one,
    and completes."""
    sent, began = len(loop.receiver.messages), time.monotonic()
    run_id = loop.start("register.start:wait", ["train.seed=5"], force=True)
    loop.wait_reached("register.start", run_id)
    logged = len(loop.worker_log.read_text(errors="replace"))
    loop.stop_mlflow()
    stopped = time.monotonic()
    loop.release("register.start")
    time.sleep(5)  # the outage itself, not a wait for a timing to land: the run must wait it out
    loop.proxy.lose_next("/model-versions/create")
    loop.start_mlflow()
    down = time.monotonic() - stopped
    faulted = loop.finish(run_id)
    assert faulted["state_type"] == "COMPLETED", loop.failed(f"after an MLflow outage: {faulted['state_type']}")
    assert loop.proxy.lost == ["/api/2.0/mlflow/model-versions/create"], loop.proxy.lost
    # The run met the outage: it said so while it waited (xbn.tracking.services.wait_reachable).
    waited = loop.worker_log.read_text(errors="replace")[logged:]
    assert "left of tracking.outage_s" in waited, loop.failed("the run never met the outage")
    state = run_after(loop, "MLflow down mid-register; create response lost", began, faulted, sent,
                      mlflow_down_s=round(down, 1))
    assert sorted(state["versions"]) == [1, 2, 3, 4]
    titles = loop.messages_since(sent)  # the verdict on v4 only: the outage and the lost answer were waited out
    assert len(titles) == 1 and titles[0].startswith("xbn: v4 "), titles


def case_cut_dvc_files_and_a_foreign_rwlock(loop: Loop) -> None:
    """The data's `.dvc` record and dvc.lock cut short, and DVC's rwlock naming a live process that is not
    DVC: the next run repairs them and completes (nothing changed: no training)."""
    import json

    record_file = loop.workdir / "data" / "catalogue.dvc"
    lock_file, rwlock = loop.workdir / "dvc.lock", loop.workdir / ".dvc" / "tmp" / "rwlock"
    record_file.write_text(record_file.read_text()[:25])
    lock_file.write_text("schema: '2.0'\nstages:\n  prepare:\n    cmd: xbn prep")
    foreign = subprocess.Popen(["sleep", "600"])
    try:
        rwlock.parent.mkdir(parents=True, exist_ok=True)
        rwlock.write_text(json.dumps({"read": {}, "write": {str(loop.workdir / "data" / "catalogue"): {
            "pid": foreign.pid, "cmd": "dvc add data/catalogue"}}}))
        sent, began = len(loop.receiver.messages), time.monotonic()
        state = run_after(loop, "cut .dvc and dvc.lock, rwlock with a live foreign PID", began,
                          {"state_name": "(files cut between runs)"}, sent)
    finally:
        foreign.kill()
    assert sorted(state["versions"]) == [1, 2, 3, 4]  # nothing changed: nothing trained
    entries = [e for kind in ("read", "write") for e in json.loads(rwlock.read_text()).get(kind, {}).values()]
    assert all(e["pid"] != foreign.pid for e in (x for v in entries for x in (v if isinstance(v, list) else [v])))


def case_an_awaiting_version_with_a_tampered_checkpoint_is_abandoned(loop: Loop) -> None:
    """Issue 54 item 2, as deployed: a run of a second model (no champion yet, so the gate promotes) is SIGKILLed
    after register, before the catalogue flow attached its index (v1 `awaiting_index`), and v1's checkpoint is
    then corrupted in the artifact store. The next scheduled run abandons v1 (held, with the reason, never
    champion), says so in a notification, and goes on: it trains v2, which the gate promotes and the catalogue
    flow indexes. Before, the repair's IntegrityError failed this run and every later one."""
    from mlflow import MlflowClient

    from xbn.tracking import file_digest
    from xbn.tracking.registry import SHA_TAG

    other = ("registry.model_name=xbn-faults-abandon",)
    sent, began = len(loop.receiver.messages), time.monotonic()
    faulted = loop.finish(loop.start("retrain.after_register:kill", [*other, "train.seed=6"], force=True))
    assert faulted["state_type"] == "CRASHED", loop.failed(f"ended {faulted['state_type']}")
    v1 = MlflowClient(loop.mlflow_url).get_model_version("xbn-faults-abandon", "1")
    assert v1.tags.get("registration") == "awaiting_index", v1.tags
    stored = [p for p in (loop.home / "artifacts").rglob("model.pt") if file_digest(p) == v1.tags[SHA_TAG]]
    assert stored, f"v1's checkpoint ({v1.tags[SHA_TAG][:12]}) is not in the artifact store"
    for path in stored:  # the run's copy and the registered model's, if the store keeps two
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    state = run_after(loop, "SIGKILL awaiting its index; its checkpoint corrupted", began, faulted, sent, other)
    assert state["versions"] == {1: "held", 2: "promoted"} and state["champion"] == 2, state
    v1 = MlflowClient(loop.mlflow_url).get_model_version("xbn-faults-abandon", "1")
    assert v1.tags["registration"] == "abandoned" and "IntegrityError" in v1.tags["reason"], v1.tags
    titles = loop.messages_since(sent)
    assert titles[:2] == [f"xbn retrain CRASHED: {faulted['name']}", "xbn: v1 registration abandoned"], titles
    assert len(titles) == 3 and titles[2].startswith("xbn: v2 "), titles


def planted_in(dump: str) -> list[str]:
    """`table.column` of each value in a pg_dump that holds the planted secret."""
    found, columns, table = [], [], None
    for line in dump.splitlines():
        if line.startswith("COPY "):
            table, _, rest = line[5:].partition(" (")
            columns = rest.split(") FROM")[0].split(", ")
        elif line == "\\.":
            table = None
        elif table and PLANTED in line:
            found += [f"{table}.{name}: {value[:300]}" for name, value in zip(columns, line.split("\t"))
                      if PLANTED in value]
        elif PLANTED in line:
            found.append(line[:300])
    return found


def case_the_catalogue_then_no_planted_secret_anywhere(loop: Loop) -> None:
    """Issue 41 item 3: `xbn catalogue` (a flow run; the champion's catalogue index is up to date) runs with the
    planted secrets in its environment like every run before it, then a deployment run whose MLflow calls fail
    (issue 54 item 7). Then no record holds them:
    every row of Prefect's and MLflow's databases (flow-run parameters, logs, artifacts, params, tags,
    descriptions), every file in the artifact store, the DVC remote, the project's reports/, metrics/ and models/,
    what the worker and the commands printed, and the notifications received."""
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "xbn.cli", "catalogue", "--params", "params.yaml",
                           *(f"--set={o}" for o in loop.overrides), "--set=catalogue.source=data/catalogue",
                           "--set=catalogue.workers=1"], cwd=loop.workdir, env=loop.env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "already serves this catalogue's index" in done.stderr, done.stdout[-2000:] + done.stderr[-2000:]
    state = assert_healthy(loop)
    # Then a deployment run whose MLflow calls fail (the server stops once the run holds its lock; no outage is
    # waited out, MLflow's own retries are off): what Prefect records of the failure (the task's state, the
    # traceback its engine logs, the notification) names the store, whose URI holds the planted password.
    sent = len(loop.receiver.messages)
    run_id = loop.start("retrain.locked:wait", ["tracking.outage_s=0"], force=True,
                        env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"})
    loop.wait_reached("retrain.locked", run_id)
    loop.stop_mlflow()
    try:
        loop.release("retrain.locked")
        failed = loop.finish(run_id)
    finally:
        loop.start_mlflow()
    assert failed["state_type"] == "FAILED", loop.failed(f"with MLflow down: {failed['state_type']}")
    assert [t.split(":")[0] for t in loop.messages_since(sent)] == ["xbn retrain FAILED"], loop.messages_since(sent)
    record(loop, "planted secrets; xbn catalogue; a run whose MLflow calls fail", faulted_run=failed["state_name"],
           catalogue_s=round(time.monotonic() - began, 1), **state)
    dumps = {db: loop.pg.dump(db) for db in ("prefect", "mlflow")}
    assert f"127.0.0.1:{loop.proxy.port}" in dumps["prefect"]  # the failure, naming the store, is recorded
    found = [f"the {db} database: {where}" for db, dump in dumps.items() for where in planted_in(dump)]
    for folder in (loop.home / "artifacts", loop.home / "dvc-remote", loop.workdir / "reports",
                   loop.workdir / "metrics", loop.workdir / "models"):
        found += [str(path) for path in folder.rglob("*") if path.is_file() and PLANTED.encode() in path.read_bytes()]
    # What the worker and the commands printed: a container's output is a log someone keeps.
    printed = loop.worker_log.read_text(errors="replace").splitlines() + (done.stdout + done.stderr).splitlines()
    found += [f"printed: {line[:200]!r}" for line in printed if PLANTED in line]
    found += [f"notification {m.get('title')!r}" for m in loop.receiver.messages if PLANTED in json.dumps(m)]
    assert (loop.workdir / "reports").is_dir() and loop.receiver.messages  # something to search
    assert not found, f"a planted secret landed in: {found}"


def redraw(path: Path) -> None:
    """Replace an image in place with another drawing (same path and size, other bytes)."""
    from PIL import Image

    with Image.open(path) as image:
        changed = image.copy()
    changed.putpixel((0, 0), 128 if changed.getpixel((0, 0)) != 128 else 0)
    changed.save(path)


def case_new_classes_fine_tune_the_champion_across_a_prefect_server_restart(loop: Loop) -> None:
    """Issues 14, 24, 25 and 40, as a user who deployed the schedule lives them. Three classes are added and three
    images redrawn in place, so the next run (not forced) fine-tunes the champion, with DataLoader workers on
    (data.num_workers=2: they died with exit code 1 in flow runs). While it waits after training, a second run
    started with `prefect deployment run` waits for the deployment's one slot (AwaitingConcurrencySlot, proposed
    by the worker and held back by the server), and the Prefect server restarts: it still holds the running
    flow's lease (on disk, as compose keeps them; in memory the run crashed), and the run completes. Its drift
    report names the classes, the notification gives the verdict with the test R@1 and the flow run's link, and
    each version's images come back exactly from the DVC remote, also in a fresh project that has only the
    remote's address and the tracking store."""
    from xbn.data.glyphs import generate_glyphs
    from xbn.tracking import Registry

    champion = Registry(loop.params()).by_alias("champion")
    assert champion is not None, "no champion to fine-tune"
    catalogue, sent, began = loop.workdir / "data" / "catalogue", len(loop.receiver.messages), time.monotonic()
    before = digests(catalogue)
    generated = generate_glyphs(loop.home / "glyphs-27", classes=27, images_per_class=4, image_size=32, seed=0)
    for folder in sorted((generated / "images").iterdir())[24:]:
        shutil.copytree(folder, catalogue / folder.name)
    for path in sorted(catalogue.rglob("*.png"))[:3]:
        redraw(path)
    after = digests(catalogue)
    logged = len(loop.worker_log.read_text(errors="replace"))

    run_id = loop.start("retrain.after_train:wait", ["data.num_workers=2"])
    loop.wait_reached("retrain.after_train", run_id)
    started = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", DEPLOYMENT, "--params",
                              json.dumps({"overrides": loop.overrides})], cwd=loop.workdir, env=loop.env,
                             capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stdout + started.stderr
    second = next(line.split("UUID:")[1].strip() for line in started.stdout.splitlines() if "UUID:" in line)
    deadline = time.monotonic() + 120
    while (waiting := loop.state(second))["state_name"] != "AwaitingConcurrencySlot":
        assert waiting["state_type"] in ("SCHEDULED", "PENDING"), loop.failed(f"second run: {waiting['state_name']}")
        assert time.monotonic() < deadline, loop.failed(f"the second run never waited for the slot: {waiting}")
        time.sleep(0.5)
    down = loop.restart_prefect()
    _, deployment = loop.api(f"/deployments/{loop.deployment_id}")
    limit = deployment["global_concurrency_limit"]["id"]
    leases = Path(loop.env["PREFECT_HOME"]) / "concurrency_leases"
    held = [path.read_text() for path in leases.glob("*.json") if path.name != "expirations.json"]
    assert any(limit in text for text in held), loop.failed(f"no lease on {limit} after the restart: {held}")
    # Not for the worker to start once the slot frees: it would train the same data again.
    assert loop.api(f"/flow_runs/{second}", method="DELETE")[0] == 204
    loop.release("retrain.after_train")
    run = loop.finish(run_id)
    assert run["state_type"] == "COMPLETED", loop.failed(f"after a Prefect server restart: {run['state_type']}")
    printed = loop.worker_log.read_text(errors="replace")[logged:]
    assert not re.search(r"exited unexpectedly|Retry \d+/\d+", printed), loop.failed("a task failed and was retried")

    from mlflow import MlflowClient

    name = loop.params().registry.model_name
    versions = {int(v.version): v for v in MlflowClient(loop.mlflow_url).search_model_versions(f"name='{name}'")}
    tuned = versions[max(versions)]
    assert tuned.tags["parent_version"] == str(champion.version), tuned.tags
    assert tuned.tags["data_md5"] != champion.tags["data_md5"]
    drift = json.loads((loop.workdir / "reports" / "drift.json").read_text())
    assert drift["changes"]["classes_added"] == {"count": 3, "examples": ["0024", "0025", "0026"]}, drift["changes"]
    assert drift["champion_version"] == int(champion.version) and "+3 classes (0024, 0025, 0026)" in drift["line"]
    assert drift["changes"]["images_changed"]["count"] == 3
    # The two-sample test's picture (the permutation null, the projected embeddings) when it ran.
    assert (loop.workdir / "reports" / "drift.png").exists() == drift["embedding"]["tested"]
    promoted = tuned.tags["decision"] == "promoted"
    state = assert_healthy(loop, indexed=108 if promoted else 96)
    verdict = "promoted to champion" if promoted else f"held for review ({tuned.tags['decision']})"
    titles = loop.messages_since(sent)
    assert titles == [f"xbn: v{tuned.version} {verdict}"], titles
    message = loop.receiver.messages[-1]["message"]
    assert "test R@1" in message and "/runs/flow-run/" in message, message
    record(loop, case_new_classes_fine_tune_the_champion_across_a_prefect_server_restart.__doc__.split(".")[0],
           faulted_run=run["state_name"], prefect_down_s=round(down, 1), next_run_s=round(run["total_run_time"], 1),
           started_to_checked_s=round(time.monotonic() - began, 1), **state, notifications=titles)

    # Issue 25: the folder and the DVC cache are gone; each version's images come back from the remote.
    shutil.rmtree(catalogue)
    shutil.rmtree(loop.workdir / ".dvc" / "cache", ignore_errors=True)
    fresh = loop.home / "fresh"
    fresh.mkdir()
    for args in (["init", "--no-scm", "-q"], ["remote", "add", "-d", "store", str(loop.home / "dvc-remote")]):
        subprocess.run([sys.executable, "-m", "dvc", *args], cwd=fresh, env=loop.env, check=True, capture_output=True)
    for where, version, expected in ((loop.workdir, champion.version, before), (loop.workdir, tuned.version, after),
                                     (fresh, champion.version, before)):
        target = loop.home / f"restored-{where.name}-v{version}"
        done = subprocess.run([sys.executable, "-m", "xbn.cli", "data", "--params", str(loop.workdir / "params.yaml"),
                               *(f"--set={o}" for o in loop.overrides), f"--set=tracking.uri={loop.mlflow_url}",
                               "restore", "--model-version", str(version), "--to", str(target)], cwd=where,
                              env=loop.env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert digests(target) == expected, f"v{version} restored in {where.name} differs"


def test_the_worker_entrypoint_deployed_prefect_yaml_behind_basic_auth(loop):
    """What infra/prefect/worker.sh left on the server before the cases run: the `xbn-process` pool, prefect.yaml's
    deployment (stored in the PostgreSQL database compose gives Prefect), its weekly schedule creating flow runs,
    the worker polling; compose's basic auth is enforced. A run by hand is queued on the pool."""
    import psycopg2

    url = loop.prefect_url
    assert api(url, "/work_pools/filter", {}, auth=None)[0] == 401
    assert api(url, "/work_pools/filter", {}, auth="admin:wrong")[0] == 401
    status, pool = loop.api("/work_pools/xbn-process")
    assert status == 200 and pool["type"] == "process"
    status, deployments = loop.api("/deployments/filter", {})
    assert status == 200 and [d["name"] for d in deployments] == ["xbn-weekly-retrain"]
    deployment = deployments[0]
    assert deployment["work_pool_name"] == "xbn-process"
    assert deployment["entrypoint"] == "pipelines/retrain.py:retrain"
    assert deployment["global_concurrency_limit"]["limit"] == 1
    assert [(s["schedule"]["cron"], s["active"]) for s in deployment["schedules"]] == [("0 3 * * 1", True)]
    deadline = time.monotonic() + 60  # the worker registers with its first heartbeat, once it polls
    while not any(w["name"].startswith("xbn-worker-")
                  for w in loop.api("/work_pools/xbn-process/workers/filter", {})[1] or []):
        assert time.monotonic() < deadline, loop.failed("the worker never registered with the pool")
        time.sleep(0.5)
    with psycopg2.connect(loop.pg.url("prefect")) as conn, conn.cursor() as cur:
        cur.execute("SELECT name FROM deployment")
        assert cur.fetchall() == [("xbn-weekly-retrain",)]
    # The scheduler (every 5 s) creates the weekly runs, far ahead of the worker's window.
    query = {"deployments": {"id": {"any_": [deployment["id"]]}}}
    deadline, runs = time.monotonic() + 30, []
    while not (runs := [r for r in loop.api("/flow_runs/filter", query)[1] or [] if r["auto_scheduled"]]):
        assert time.monotonic() < deadline, "no flow run was scheduled:\n" + loop.failed("")
        time.sleep(1)
    assert {r["state_type"] for r in runs} == {"SCHEDULED"}
    # A run by hand (`prefect deployment run`), queued on the pool for the worker; scheduled a year ahead, so the
    # worker (which polls every second) leaves it, and deleted: without overrides it would train on the default.
    status, run = loop.api(f"/deployments/{deployment['id']}/create_flow_run",
                           {"state": {"type": "SCHEDULED", "state_details": {"scheduled_time": "2100-01-04T03:00:00Z"}}})
    assert status == 201 and run["state"]["type"] == "SCHEDULED" and run["work_queue_name"] == "default", run
    assert loop.api(f"/flow_runs/{run['id']}", method="DELETE")[0] == 204


# In the order they run: each case builds on the registry the ones before it left (one stack per module; make
# test's --dist loadfile keeps the module on one worker). A case that fails does not stop the next.
CASES = (case_killed_after_the_champion_alias_moved, case_killed_after_training, case_killed_after_create,
         case_postgres_restarted_mid_flow_while_xbn_retrain_is_refused,
         case_mlflow_down_mid_register_and_a_lost_create_response,
         case_cut_dvc_files_and_a_foreign_rwlock, case_an_awaiting_version_with_a_tampered_checkpoint_is_abandoned,
         case_the_catalogue_then_no_planted_secret_anywhere,
         case_new_classes_fine_tune_the_champion_across_a_prefect_server_restart)


def selected_cases(only: str | None) -> list:
    """`$XBN_FAULT_CASES` ("killed_after,planted": a part of a case's name each), to run some cases while working
    on them; a part that names no case is an error, so a typo cannot pass by running nothing."""
    if only is None:
        return list(CASES)
    parts = [p for p in only.split(",") if p]
    if unknown := [p for p in parts if not any(p in case.__name__ for case in CASES)] or not parts:
        raise ValueError(f"XBN_FAULT_CASES={only!r}: {', '.join(unknown) or 'nothing'} names no fault case "
                         f"(cases: {', '.join(c.__name__.removeprefix('case_') for c in CASES)})")
    return [case for case in CASES if any(p in case.__name__ for p in parts)]


@pytest.mark.parametrize("case", selected_cases(os.environ.get("XBN_FAULT_CASES")),
                         ids=lambda case: case.__name__.removeprefix("case_"))
def test_the_weekly_loop_survives(loop, case):
    case(loop)
    print("timeline:", json.dumps(loop.timeline[-1:], indent=1))


def test_an_unknown_fault_case_is_an_error_not_an_empty_run():
    with pytest.raises(ValueError, match="killed_afterr names no fault case"):
        selected_cases("killed_afterr")
    assert selected_cases("planted") == [case_the_catalogue_then_no_planted_secret_anywhere]
