"""Parallel workers for real: two processes on the real PostgreSQL at 127.0.0.1:5432 (and on a journal file)
finish exactly the requested trials, none lost or duplicated; a worker that dies has its trial marked failed
(by heartbeats on PostgreSQL, by the coordinator on a journal) and the study goes on.

The worker to kill is held at the fault point `tune.in_trial` (its trial running, its worker recorded) until
it is killed: a trial that finished between the poll that saw it running and the kill would make the test
see a completed trial where it expects a failed one (a CI run did)."""

import os
import signal
import subprocess
import sys
import threading
import time

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from xbn.stages.tune import tune
from xbn.tuning.storage import journal_storage
from xbn.tuning.study import ERROR_ATTR, WORKER_ATTR
from xbn.utils.faults import FAULT_DIR_ENV, FAULT_ENV

from .helpers import child_runs

pytestmark = pytest.mark.slow
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
HELD_IN_TRIAL = "tune.in_trial:wait"


def wait_for_running_trial(load_study, pid: int | None = None, timeout: float = 120.0):
    """The first running trial (of worker `pid`, if given) once it has started; polls the storage."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            for trial in load_study().get_trials(states=(TrialState.RUNNING,)):
                worker = trial.user_attrs.get(WORKER_ATTR, "")
                if worker and (pid is None or worker.endswith(f":{pid}")):
                    return trial
        except KeyError:  # the study does not exist yet
            pass
        time.sleep(0.2)
    raise AssertionError("no trial started in time")


def test_postgresql_workers_finish_exactly_the_requested_trials_and_outlive_a_dead_one(project, postgres_url,
                                                                                      tmp_path):
    params = project("tune.trials=4", f"tune.storage={postgres_url}", "tune.study_name=shared",
                     "tune.epochs=2")
    params_file = tmp_path / "worker.yaml"
    params_file.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    # A worker the coordinator does not know (as on another machine) dies in its trial: only its heartbeats
    # can tell.
    with open(tmp_path / "worker.log", "wb") as log:
        command = [sys.executable, "-m", "xbn.cli", "tune", "--worker", "--params", str(params_file)]
        held = {**os.environ, FAULT_ENV: HELD_IN_TRIAL, FAULT_DIR_ENV: str(tmp_path)}
        stray = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=held)
    try:
        lost = wait_for_running_trial(lambda: optuna.load_study(study_name="shared", storage=postgres_url),
                                      stray.pid)
    finally:
        stray.kill()
        stray.wait()

    summary = tune(params, workers=2)

    trials = optuna.load_study(study_name="shared", storage=postgres_url).get_trials()
    assert sorted(t.number for t in trials) == [0, 1, 2, 3]  # the dead worker's trial counts: 3 more ran
    assert trials[lost.number].state == TrialState.FAIL and ERROR_ATTR not in trials[lost.number].user_attrs
    done = [t for t in trials if t.number != lost.number]
    assert all(t.state in FINISHED for t in done), [t.state for t in done]  # none failed, waiting or running
    assert len({t.user_attrs[WORKER_ATTR] for t in done}) == 2  # both workers took part
    assert len({tuple(sorted(t.params.items())) for t in trials}) == 4  # no configuration ran twice
    assert summary["trials"]["total"] == 4 and summary["failed"] == {lost.number: "worker lost or interrupted"}
    runs = {int(r.data.tags["optuna.trial_number"]): r for r in child_runs(params, summary["mlflow_run_id"])}
    assert sorted(runs) == [0, 1, 2, 3]  # one MLflow child run per trial
    assert runs[lost.number].info.status == "FAILED"  # the dead worker's run, closed for it


def test_workers_share_a_journal_and_a_killed_worker_costs_one_trial(project, tmp_path, monkeypatch):
    params = project("tune.trials=4", "tune.epochs=2", "tracking.enabled=false")
    monkeypatch.setenv(FAULT_ENV, HELD_IN_TRIAL)  # both workers wait in their first trial until released
    monkeypatch.setenv(FAULT_DIR_ENV, str(tmp_path))
    result = {}
    coordinator = threading.Thread(target=lambda: result.update(tune(params, workers=2)))
    coordinator.start()
    journal = tmp_path / "tuning/optuna.journal"

    def load_study():
        if not journal.exists():
            raise KeyError("no study yet")
        storage = journal_storage(journal)  # the workers' own lock
        names = optuna.get_all_study_names(storage)
        if not names:  # the journal file exists before the study's first record lands in it
            raise KeyError("no study yet")
        return optuna.load_study(study_name=names[0], storage=storage)

    try:
        lost = wait_for_running_trial(load_study)
        os.kill(int(lost.user_attrs[WORKER_ATTR].rpartition(":")[2]), signal.SIGKILL)
    finally:
        (tmp_path / "tune.in_trial.release").touch()  # the other worker goes on
        coordinator.join(timeout=300)  # before the fixture leaves tmp_path
    assert result, "the coordinator did not finish"
    trials = load_study().get_trials()
    assert len(trials) == 4 and trials[lost.number].state == TrialState.FAIL
    assert sum(t.state in FINISHED for t in trials) == 3
    assert len(result["worker_failures"]) == 1 and result["failed"] == {lost.number: "worker lost or interrupted"}
