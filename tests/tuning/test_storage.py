"""Storages and the trial budget without training: the claim under the study lock is exact under contention,
a study is not silently mixed with other params, and a --worker needs a shared storage."""

import os
import signal
import subprocess
import sys
import threading
import time

import optuna
import pytest

from tests_support import ROOT
from xbn.config import ConfigError, load_params
from xbn.stages.tune import tune
from xbn.tuning import open_study, resolve_storage, run_worker
from xbn.tuning.storage import journal_storage
from xbn.tuning.study import fail_lost_trials


def test_workers_racing_on_a_journal_create_exactly_the_budget(tmp_path):
    params = load_params(ROOT / "params.yaml", [f"tune.storage=journal:{tmp_path / 'j.journal'}",
                                                "tune.study_name=race"])
    spec = resolve_storage(params.tune, 4)
    ran: list[int] = []

    def objective(trial):
        time.sleep(0.01)  # long enough for the workers to interleave
        return trial.suggest_float("x", 0.0, 1.0)

    def work():  # each worker its own session and lock, as in its own process
        ran.append(run_worker(open_study(params, spec, seed=None), objective, trials=12))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    trials = optuna.load_study(study_name="race", storage=journal_storage(tmp_path / "j.journal")).get_trials()
    assert sum(ran) == 12 and sorted(t.number for t in trials) == list(range(12))
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)


def test_a_trial_failed_by_another_worker_meanwhile_is_dropped_and_its_worker_goes_on(tmp_path, caplog):
    """A worker stalled past grace_period (its heartbeat thread starved on a loaded machine) has its trial marked
    failed by another worker's check, then finishes it: its result is dropped with a warning, and the worker
    goes on with the next trial instead of dying on Optuna's "Cannot tell a FAIL trial" (seen in make test)."""
    # One beat when the trial starts, none after: silent for the 1 s grace period, as a starved thread is.
    params = load_params(ROOT / "params.yaml", [f"tune.storage=sqlite:///{tmp_path / 'o.db'}",
                                                "tune.study_name=stalled", "tune.heartbeat_interval=60",
                                                "tune.grace_period=1"])
    spec = resolve_storage(params.tune, 1)
    other = open_study(params, spec, seed=None)  # the other worker, as in its own process

    def objective(trial):
        x = trial.suggest_float("x", 0.0, 1.0)
        deadline = time.monotonic() + 30
        while trial.number < 2 and other.study.trials[trial.number].state != optuna.trial.TrialState.FAIL:
            assert time.monotonic() < deadline, "the silent worker's trial was never failed"
            time.sleep(0.2)
            fail_lost_trials(other)  # what the other worker does before each trial
        if trial.number == 1:
            trial.report(x, step=1)  # an epoch's report after the failure (trial 0: the end of the trial)
        return x

    assert run_worker(open_study(params, spec, seed=None), objective, trials=3) == 3
    trials = other.study.get_trials()
    FAIL, COMPLETE = optuna.trial.TrialState.FAIL, optuna.trial.TrialState.COMPLETE
    assert [t.state for t in trials] == [FAIL, FAIL, COMPLETE]
    assert trials[0].values is None and not trials[1].intermediate_values  # the stalled results were dropped
    for number in (0, 1):
        assert f"trial {number} was marked failed by another worker while it ran here" in caplog.text


def test_a_named_study_refuses_params_it_was_not_run_with(tmp_path):
    storage = f"tune.storage=sqlite:///{tmp_path / 'o.db'}"
    first = load_params(ROOT / "params.yaml", [storage, "tune.study_name=s"])
    open_study(first, resolve_storage(first.tune, 1), seed=0)
    # More trials or another pruner: the same study goes on. Another memory size: refused.
    same = load_params(ROOT / "params.yaml", [storage, "tune.study_name=s", "tune.trials=50", "tune.pruner=none"])
    open_study(same, resolve_storage(same.tune, 1), seed=0)
    other = load_params(ROOT / "params.yaml", [storage, "tune.study_name=s", "memory.method=axbn"])
    with pytest.raises(ConfigError, match="study 's' .* was run with other params"):
        open_study(other, resolve_storage(other.tune, 1), seed=0)


def test_a_worker_without_a_shared_storage_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"tune\.storage: a --worker joins a shared study"):
        tune(load_params(ROOT / "params.yaml"), worker=True)


def test_a_process_killed_inside_the_journal_lock_does_not_block_the_others(tmp_path, monkeypatch):
    # Relative path, as with the default tune.dir: Optuna's symlink lock left by a killed holder was never
    # broken then (its stale check followed a dangling relative link), and the CI run hung on it.
    monkeypatch.chdir(tmp_path)
    optuna.create_study(study_name="s", storage=journal_storage("tuning/j.journal"))
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from xbn.tuning.storage import journal_storage\n"
        "lock = journal_storage('tuning/j.journal')._backend._lock\n"
        "lock.acquire(); print('held', flush=True); time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    study = optuna.load_study(study_name="s", storage=journal_storage("tuning/j.journal"))
    done = threading.Event()
    threading.Thread(target=lambda: (study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2),
                                     done.set()), daemon=True).start()
    assert done.wait(30), "the journal stayed locked after its holder was killed"
    assert len(study.get_trials()) == 2


def test_the_environments_storage_wins_and_its_password_is_never_shown(tmp_path, monkeypatch):
    """$OPTUNA_STORAGE (compose sets it) is read, so a study's password need not sit in params.yaml; an error
    about it names the variable and masks the password."""
    cfg = load_params(None, [f"tune.dir={tmp_path}", "tune.storage=journal:from-params.journal"]).tune
    monkeypatch.setenv("OPTUNA_STORAGE", f"journal:{tmp_path / 'from-env.journal'}")
    assert resolve_storage(cfg, workers=2).url == f"journal:{tmp_path / 'from-env.journal'}"
    monkeypatch.setenv("OPTUNA_STORAGE", "sqlite:///study.db")
    with pytest.raises(ConfigError, match=r"^\$OPTUNA_STORAGE: SQLite is not safe for parallel workers"):
        resolve_storage(cfg, workers=2)
    monkeypatch.setenv("OPTUNA_STORAGE", "postgresql://optuna:hunter2@db:notaport/optuna")
    with pytest.raises(ConfigError, match=r"^\$OPTUNA_STORAGE: 'postgresql://optuna:\*\*\*@db:notaport/optuna' is "
                                          "neither") as refused:
        resolve_storage(cfg, workers=2)
    assert "hunter2" not in str(refused.value)
    monkeypatch.delenv("OPTUNA_STORAGE")
    assert resolve_storage(cfg, workers=2).url == "journal:from-params.journal"
