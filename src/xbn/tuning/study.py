"""The study, its trials and its workers.

A trial trains with the sampled values applied as overrides to the study's resolved params file, for
`tune.epochs` epochs, in its own `tune.dir/<study>/trial_N/` (checkpoints and metrics never touch `models/`),
with the training stage's own tracking off (the trial's MLflow child run records it). After every epoch it
reports validation R@1 (the class-disjoint `val` split) and is pruned when the pruner says so.

A worker loops: under the study lock it counts the study's trials and, while fewer than `tune.trials`,
creates the next one (`study.ask()`), then runs it outside the lock and `tell`s the result. Every trial is
created under the lock and the count covers every state, so exactly `tune.trials` trials exist in the end,
however many workers on however many machines: none lost, none extra. (`study.optimize` with Optuna's
MaxTrialsCallback checks after a trial, so parallel workers overshoot by up to workers - 1; and an enqueued
claim popped by `optimize` can be taken by another worker's pop while a fresh trial is created instead.)
On database storages the worker records the trial's heartbeat as `optimize` would, so a worker that dies on
any machine has its trial marked failed after `grace_period`.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import optuna
from optuna.storages import BaseStorage, RDBStorage
from optuna.trial import TrialState

from xbn.config import ConfigError, Params, flatten, load_params
from xbn.tuning.space import SearchSpace, as_overrides
from xbn.tuning.storage import StorageSpec, open_storage, study_lock
from xbn.utils.errors import NonFiniteLossError
from xbn.utils.faults import fault_point

log = logging.getLogger(__name__)

OBJECTIVE = "val_recall@1"
WORKER_ATTR, BASELINE_ATTR, ERROR_ATTR = "xbn.worker", "xbn.baseline", "xbn.error"
FINGERPRINT_ATTR, MLFLOW_RUN_ATTR = "xbn.fingerprint", "xbn.mlflow_run_id"
# Keys that change how fast or where a trial runs, not what it scores: a study survives changes to them.
_NOT_SCORED = ("tracking", "registry", "validate", "eval", "data.num_workers", "train.device",
               "train.log_every", "train.checkpoint_dir", "train.metrics_dir")
_SCORED_TUNE = ("space", "lambda_mode", "epochs", "max_batch_size")


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def fingerprint(params: Params) -> str:
    """sha256 of what a trial's score depends on: the params less bookkeeping, plus
    tune.space/lambda_mode/epochs."""
    data = params.model_dump(mode="json")
    data["tune"] = {k: data["tune"][k] for k in _SCORED_TUNE}
    flat = {k: v for k, v in flatten(data).items() if not k.startswith(_NOT_SCORED)}
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()


def study_name(params: Params) -> str:
    d, method = params.data.dataset, params.memory.method
    return params.tune.study_name or f"xbn-{d}-{method}-{fingerprint(params)[:8]}"


def make_pruner(params: Params) -> optuna.pruners.BasePruner:
    t = params.tune
    first = params.train.warmup_epochs + 1  # epochs are steps; the head-only warm-up says little
    if t.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=t.pruner_startup_trials, n_warmup_steps=first)
    if t.pruner == "hyperband":
        last = params.train.warmup_epochs + t.epochs
        return optuna.pruners.HyperbandPruner(min_resource=first, max_resource=last, reduction_factor=3)
    return optuna.pruners.NopPruner()


@dataclass
class StudySession:
    """One process's handle on the study: storage, lock and the optuna.Study."""

    spec: StorageSpec
    storage: BaseStorage
    study: optuna.Study
    lock: Any  # a context manager (see storage.study_lock)

    @property
    def name(self) -> str:
        return self.study.study_name


def open_study(params: Params, spec: StorageSpec, seed: int | None,
               pruner: optuna.pruners.BasePruner | None = None) -> StudySession:
    """Create or join the study. A study created with other scored params is refused (its trials would not
    be comparable): choose another tune.study_name."""
    name = study_name(params)
    lock = study_lock(spec, name)
    with lock:  # creating tables and the study is racy between workers that start together
        storage = open_storage(spec, params.tune)
        study = optuna.create_study(
            storage=storage, study_name=name, direction="maximize", load_if_exists=True,
            sampler=optuna.samplers.TPESampler(seed=seed), pruner=pruner or make_pruner(params))
        mine, theirs = fingerprint(params), study.user_attrs.get(FINGERPRINT_ATTR)
        if theirs is None:
            study.set_user_attr(FINGERPRINT_ATTR, mine)
        elif theirs != mine:
            raise ConfigError(f"tune.study_name: study '{name}' in {spec.redacted()} was run with other "
                              "params (data, model, memory, loss, train or tune.space/lambda_mode/epochs); "
                              "choose another tune.study_name or leave it null")
    return StudySession(spec, storage, study, lock)


class Objective:
    """One trial: sample, train on the trial's params, report val R@1 per epoch, return the best."""

    def __init__(self, params_file: str | Path, base: Params, space: SearchSpace, trial_root: str | Path,
                 tracker: Any | None = None):
        self.params_file, self.base, self.space = Path(params_file), base, space
        self.trial_root, self.tracker = Path(trial_root), tracker

    def trial_params(self, number: int, sampled: dict[str, Any]) -> Params:
        folder = self.trial_root / f"trial_{number}"
        return load_params(self.params_file, as_overrides({
            **self.space.to_params(sampled, self.base),
            "train.epochs": self.base.tune.epochs,
            "train.checkpoint_dir": str(folder / "models"),
            "train.metrics_dir": str(folder / "metrics"),
            "tracking.enabled": False,
        }))

    def __call__(self, trial: optuna.Trial) -> float:
        from xbn.training import fit  # a trial is the bare loop: its params turn tracking off

        sampled = self.space.sample(trial)
        params = self.trial_params(trial.number, sampled)
        run = self.tracker.start_trial(trial.number, sampled, params) if self.tracker else None
        trial.set_user_attr(WORKER_ATTR, worker_id())  # who runs it: a journal's stand-in for heartbeats
        fault_point("tune.in_trial")  # a worker killed mid-trial (tests/tuning/test_workers.py waits here)
        state, value = "FAIL", None
        try:
            summary = fit(params, progress=False, on_epoch=self._reporter(trial, run))
            value = summary.get(f"best_{OBJECTIVE}")
            if value is None:
                raise RuntimeError(f"trial {trial.number}: training reported no {OBJECTIVE}")
            trial.set_user_attr("best_epoch", summary["best_epoch"])
            state = "COMPLETE"
            return float(value)
        except optuna.TrialPruned:
            state = "PRUNED"
            raise
        except optuna.exceptions.UpdateFinishedTrialError:  # failed by another worker meanwhile (_run_trial)
            raise
        except Exception as exc:
            trial.set_user_attr(ERROR_ATTR, f"{type(exc).__name__}: {exc}"[:500])
            raise
        finally:
            if run is not None:
                run.end(state, value)
            if not self.base.tune.keep_checkpoints:
                shutil.rmtree(Path(params.train.checkpoint_dir), ignore_errors=True)
            gc.collect()  # the trial's model and loaders, before the next trial builds its own

    @staticmethod
    def _reporter(trial: optuna.Trial, run) -> Callable[[int, dict], None]:
        def on_epoch(epoch: int, row: dict) -> None:
            if run is not None:
                run.log_epoch(epoch, row)
            score = row.get(OBJECTIVE)
            if score is None:
                raise RuntimeError(f"epoch {epoch} has no {OBJECTIVE}: is there a val split?")
            trial.report(score, epoch)
            if trial.should_prune():
                raise optuna.TrialPruned(f"epoch {epoch}: {OBJECTIVE} {score:.4f}")

        return on_epoch


def run_worker(session: StudySession, objective: Objective | Callable[[optuna.Trial], float], trials: int, *,
               timeout_s: float | None = None, baseline: dict[str, Any] | None = None) -> int:
    """Run trials until the study has `trials` of them (or `timeout_s` passed); returns how many ran here.
    Trials whose configuration diverges (non-finite loss) or runs out of memory fail and the study goes on;
    any other error marks the trial failed and stops this worker."""
    catch: tuple[type[Exception], ...] = (NonFiniteLossError, _out_of_memory())
    study, deadline, ran = session.study, None if timeout_s is None else time.monotonic() + timeout_s, 0
    while deadline is None or time.monotonic() < deadline:
        fail_lost_trials(session)
        with session.lock:
            existing = len(study.get_trials(deepcopy=False))
            if existing >= trials:
                break
            if existing == 0 and baseline is not None:
                study.enqueue_trial(baseline, user_attrs={BASELINE_ATTR: True}, skip_if_exists=False)
            with warnings.catch_warnings():  # "heartbeat ... used with Study.optimize": _Heartbeat does it
                warnings.filterwarnings("ignore", message="Heartbeat of storage", category=UserWarning)
                trial = study.ask()  # pops the baseline if it was just enqueued
            heartbeat = _Heartbeat(session, trial.number)
        with heartbeat:
            _run_trial(study, trial, objective, catch)
        ran += 1
    return ran


def _run_trial(study: optuna.Study, trial: optuna.Trial, objective: Callable[[optuna.Trial], float],
               catch: tuple[type[Exception], ...]) -> None:
    try:
        value = objective(trial)
    except optuna.TrialPruned as exc:
        if _tell(study, trial, TrialState.PRUNED):  # Optuna keeps the last reported value
            log.info("trial %d pruned at %s", trial.number, exc)
    except optuna.exceptions.UpdateFinishedTrialError:  # an epoch's report, after another worker failed it
        _dropped(trial)
    except catch as exc:
        _tell(study, trial, TrialState.FAIL)
        log.warning("trial %d failed, the study goes on: %r", trial.number, exc)
    except BaseException:
        _tell(study, trial, TrialState.FAIL)
        raise
    else:
        if _tell(study, trial, TrialState.COMPLETE, value):
            log.info("trial %d: %s %.4f with %s", trial.number, OBJECTIVE, value, trial.params)


# A trial can end twice: a worker stalled past `tune.grace_period` (its heartbeat thread starved on a loaded
# machine) has it marked failed by another worker's `fail_lost_trials`, then reports or finishes it. Optuna then
# raises ("Cannot tell a FAIL trial", UpdateFinishedTrialError) and would end a worker that is alive and well:
# the trial stays failed, as the study has already counted it, and the worker goes on.
def _tell(study: optuna.Study, trial: optuna.Trial, state: TrialState, value: float | None = None) -> bool:
    """Tell Optuna how the trial ended; False if another worker had failed it meanwhile."""
    if study.tell(trial, value, state=state, skip_if_finished=True).state != state:
        _dropped(trial)
        return False
    return True


def _dropped(trial: optuna.Trial) -> None:
    log.warning("trial %d was marked failed by another worker while it ran here (no heartbeat for "
                "tune.grace_period): its result is dropped and the study goes on", trial.number)


class _Heartbeat:
    """What `study.optimize` does for a trial on a database storage: record its heartbeat now (the caller
    holds the study lock, so no worker sees the trial without one) and every `heartbeat_interval` until the
    block ends. A journal has no heartbeats: the coordinator watches its worker processes instead."""

    def __init__(self, session: StudySession, number: int):
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if session.spec.heartbeats:
            assert isinstance(session.storage, RDBStorage)  # heartbeats: a database storage (open_storage)
            self.storage = session.storage
            study_id = self.storage.get_study_id_from_name(session.name)
            self.trial_id = self.storage.get_trial_id_from_study_id_trial_number(study_id, number)
            self.storage.record_heartbeat(self.trial_id)
            self._thread = threading.Thread(target=self._beat, daemon=True, name=f"heartbeat-trial-{number}")

    def _beat(self) -> None:
        while not self._stop.wait(self.storage.get_heartbeat_interval()):
            self.storage.record_heartbeat(self.trial_id)

    def __enter__(self) -> Self:
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()


def _out_of_memory() -> type[Exception]:
    import torch

    return torch.OutOfMemoryError


def fail_trials_of(session: StudySession, worker: str, reason: str) -> list[int]:
    """Mark the running trials of a worker process that is gone as failed: its parent knows at once, where
    heartbeats take `grace_period` (and a journal has none)."""
    failed = []
    for trial in session.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if trial.user_attrs.get(WORKER_ATTR) == worker:
            try:
                session.study.tell(trial.number, state=TrialState.FAIL)
            except (ValueError, RuntimeError):  # it finished in the meantime
                continue
            failed.append(trial.number)
    if failed:
        log.warning("worker %s is gone (%s): trials %s marked failed", worker, reason, failed)
    return failed


def _alive_here(worker: str | None) -> bool | None:
    """Whether a worker process of this machine is alive; None for another machine's worker."""
    host, _, pid = (worker or "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def fail_lost_trials(session: StudySession) -> None:
    """Running trials whose worker is gone become failed: by heartbeats on database storages (any machine),
    by process liveness on a journal (one machine)."""
    if session.spec.heartbeats:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(session.study)
        return
    for trial in session.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = trial.user_attrs.get(WORKER_ATTR)
        if worker is not None and _alive_here(worker) is False:
            fail_trials_of(session, worker, "process not running")


def wait_for_running(session: StudySession, poll_s: float = 2.0) -> None:
    """Wait until no trial is running (other machines' workers finish theirs, or their heartbeats lapse), so
    the summary covers the whole study."""
    announced = False
    while running := session.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        fail_lost_trials(session)
        local = [_alive_here(t.user_attrs.get(WORKER_ATTR)) for t in running]
        if not session.spec.heartbeats and not any(local):
            log.warning("trials %s run elsewhere and a journal has no heartbeats: not waiting for them",
                        [t.number for t in running])
            return
        if not announced:
            log.info("waiting for running trials %s", [t.number for t in running])
            announced = True
        time.sleep(poll_s)
