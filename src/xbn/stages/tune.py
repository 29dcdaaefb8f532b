"""Stage `tune`: an Optuna study over `tune.space`, scored by validation R@1 -> `params.tuned.yaml`.

    tune(params)                       # one process, sqlite:///tuning/optuna.db
    tune(params, workers=4)            # 4 worker processes on this machine, journal:tuning/optuna.journal
    tune(params, worker=True)          # join the study as one more worker (another machine: tune.storage
                                       # postgresql://..., MLFLOW_TRACKING_URI at the shared server)

The coordinator (not `worker`) resolves the params (storage and study name pinned) into
`tune.dir/<study>/params.yaml`, which every worker and trial reads, runs the workers, waits until no trial is
running, then writes `tune.dir/{summary.json,trials.csv,plots/}` and `tune.output`, and logs them to the
study's MLflow run (each trial is a child run). Running it again continues the same study: only the trials
still missing from `tune.trials` run, and the outputs are rewritten.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from xbn.config import ConfigError, Params
from xbn.data import DatasetError, read_manifest
from xbn.stages.names import load_checked
from xbn.tuning import (
    MLFLOW_RUN_ATTR,
    Objective,
    SearchSpace,
    StudySession,
    apply_tuned,
    fail_lost_trials,
    fail_trials_of,
    open_study,
    resolve_storage,
    run_worker,
    study_name,
    summarize,
    tuned_values,
    wait_for_running,
    worker_id,
    write_plots,
    write_tuned,
)
from xbn.utils.io import atomic_path, write_json, write_text

log = logging.getLogger(__name__)


def tune(params: Params, *, workers: int = 1, worker: bool = False,
         apply_to: str | Path | None = None) -> dict:
    """Run (or continue) the study; returns its summary. `apply_to`: a params file to merge the best values
    into (comments kept). With `worker`, only run trials and return what this worker did."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if worker and params.tune.storage is None:
        raise ConfigError("tune.storage: a --worker joins a shared study; set tune.storage (journal:FILE on "
                          "this machine, postgresql://... across machines) as the coordinator's")
    spec = resolve_storage(params.tune, workers)
    name = study_name(params)
    study_dir = Path(params.tune.dir) / name
    resolved = _write_resolved(params, spec.url, name, study_dir / "params.yaml")
    base = load_checked(resolved)
    space = SearchSpace.from_config(base.tune, base.train.samples_per_class)
    space.check(resolved, base)
    _require_val_split(base)
    baseline = space.current(base) if base.tune.include_current else None

    if worker:
        # Workers must not sample alike.
        seed = None if base.tune.seed is None else base.tune.seed + os.getpid()
        session = open_study(base, spec, seed)
        objective = Objective(resolved, base, space, study_dir, _tracker(session, base))
        ran = run_worker(session, objective, base.tune.trials, timeout_s=base.tune.timeout_s,
                         baseline=baseline)
        return {"study": name, "worker": worker_id(), "trials_run": ran}

    session = open_study(base, spec, base.tune.seed)
    fail_lost_trials(session)  # trials of an earlier run that was killed
    tracker = _tracker(session, base)
    ok = False
    try:
        if workers == 1:
            run_worker(session, Objective(resolved, base, space, study_dir, tracker), base.tune.trials,
                       timeout_s=base.tune.timeout_s, baseline=baseline)
            failures: list[str] = []
        else:
            failures = _run_workers(session, resolved, workers, study_dir)
        wait_for_running(session)
        summary = _report(session, space, base, tracker, failures)
        ok = True
    finally:
        if tracker is not None:
            tracker.finish(ok)
    if apply_to is not None:
        apply_tuned(apply_to, tuned_values(summary))
        summary["applied_to"] = str(apply_to)
    return summary


def _require_val_split(params: Params) -> None:
    manifest = Path(params.data.manifest)
    if not manifest.exists():
        raise FileNotFoundError(f"{manifest} not found: run `xbn prepare` first")
    if not (read_manifest(manifest)["split"] == "val").any():
        raise DatasetError(f"{manifest} has no 'val' rows: tuning scores trials on the class-disjoint "
                           "validation split (never the test split); set data.val_classes > 0 and rerun "
                           "`xbn prepare`")


def _write_resolved(params: Params, storage: str, name: str, path: Path) -> Path:
    """The params every worker and trial of this study starts from, with the storage and study name pinned."""
    data = params.model_dump(mode="json")
    data["tune"].update(storage=storage, study_name=name)
    write_text(path, f"# resolved params of tuning study {name} (written by xbn tune)\n"
                     + yaml.safe_dump(data, sort_keys=False))
    return path


def _tracker(session: StudySession, params: Params):
    """The study's MLflow run, created once per study (under the study lock: workers may start together)."""
    if not params.tracking.enabled:
        return None
    from xbn.tracking.tuning import StudyTracker

    with session.lock:
        run_id = session.study.user_attrs.get(MLFLOW_RUN_ATTR)
        tracker = StudyTracker.open(params, session.name, run_id,
                                    tags={"optuna.storage": session.spec.redacted()})
        if tracker is not None and run_id is None:
            session.study.set_user_attr(MLFLOW_RUN_ATTR, tracker.run_id)
    return tracker


def _run_workers(session: StudySession, resolved: Path, workers: int, study_dir: Path) -> list[str]:
    """N worker processes (`xbn tune --worker`), each with its share of the CPU threads (and a
    GPU each, round robin, when there are several). A worker that dies has its running trial failed at once;
    the others finish the budget. Returns the failures; raises when none finished the study."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    gpus = _gpu_count() if "CUDA_VISIBLE_DEVICES" not in env else 0
    procs: list[tuple[subprocess.Popen, Path]] = []
    for i in range(workers):
        log_path = study_dir / f"worker_{i}.log"
        with open(log_path, "ab") as out:  # the child keeps its own handle
            procs.append((subprocess.Popen(
                [sys.executable, "-m", "xbn.cli", "tune", "--worker", "--params", str(resolved), "--quiet"],
                stdout=out, stderr=subprocess.STDOUT,
                env={**env, "CUDA_VISIBLE_DEVICES": str(i % gpus)} if gpus > 1 else env), log_path))
    log.info("%d workers on study %s (logs: %s/worker_*.log)", workers, session.name, study_dir)
    failures, pending = [], list(procs)
    try:
        while pending:
            for proc, log_path in list(pending):
                if (code := proc.poll()) is None:
                    continue
                pending.remove((proc, log_path))
                if code != 0:
                    failures.append(f"worker {proc.pid} exited with {code} (log: {log_path})")
                    fail_trials_of(session, f"{socket.gethostname()}:{proc.pid}", f"exit code {code}")
            time.sleep(0.5)
    except BaseException:
        # SIGINT: each worker tells its running trial FAIL before it exits; then make sure they are gone.
        for proc, _ in pending:
            proc.send_signal(signal.SIGINT)
        for proc, _ in pending:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise
    if len(failures) == workers:
        tail = procs[0][1].read_text(errors="replace")[-3000:]
        raise RuntimeError(f"every tuning worker failed: {'; '.join(failures)}\n"
                           f"--- {procs[0][1]} ---\n{tail}")
    for failure in failures:
        log.warning(failure)
    return failures


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _report(session: StudySession, space: SearchSpace, base: Params, tracker,
            failures: list[str]) -> dict[str, Any]:
    out = Path(base.tune.dir)
    summary = summarize(session, space, base)
    summary["worker_failures"] = failures
    summary["plots"] = [str(p) for p in write_plots(session.study, out / "plots", space)]
    trials_csv = out / "trials.csv"
    with atomic_path(trials_csv) as tmp:
        columns = ("number", "state", "value", "params", "user_attrs", "datetime_start", "duration")
        session.study.trials_dataframe(attrs=columns).to_csv(tmp, index=False)
    summary["trials_table"] = str(trials_csv)
    if summary["best"] is None:
        write_json(out / "summary.json", summary)
        raise RuntimeError(f"no trial of study {session.name} completed ({summary['trials']}); see "
                           f"{out / 'summary.json'}")
    write_tuned(base.tune.output, summary)
    summary["output"] = base.tune.output
    if tracker is not None:
        summary["mlflow_run_id"] = tracker.run_id
        tracker.close_lost_trials(summary["failed"])
    write_json(out / "summary.json", summary)
    if tracker is not None:
        best, current = summary["best"], summary.get("current") or {}
        metrics = {"best_val_recall@1": best["value"], "current_val_recall@1": current.get("value"),
                   **{f"trials_{k}": v for k, v in summary["trials"].items()},
                   **{f"importance/{k}": v for k, v in summary["importances"].items()}}
        tags = {"best_trial": best["trial"], **{f"best.{k}": v for k, v in best["overrides"].items()}}
        tracker.log_study(metrics, tags, [out / "summary.json", Path(base.tune.output), trials_csv],
                          [Path(p) for p in summary["plots"]])
    log.info("study %s: best trial %d, val R@1 %.4f -> %s", session.name, summary["best"]["trial"],
             summary["best"]["value"], base.tune.output)
    log.info("%s", summary["memory_verdict"])
    if "batch_verdict" in summary:
        log.info("%s", summary["batch_verdict"])
    return summary


__all__ = ["tune"]
