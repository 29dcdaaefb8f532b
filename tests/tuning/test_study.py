"""Real studies of tiny trials (one epoch each, on the tiny glyph set) in one process, SQLite storage."""

import json
import shutil
from pathlib import Path

import optuna
import pytest
import yaml
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from tests_support import ROOT
from xbn.config import LAMBDA_KEY as LAMBDA, load_params
from xbn.stages.tune import tune
from xbn.training import trainer
from xbn.tuning import BASELINE_ATTR, Objective, SearchSpace, open_study, resolve_storage, run_worker

from .helpers import child_runs

pytestmark = pytest.mark.slow
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def test_a_study_tunes_on_the_validation_split_and_writes_mergeable_values(project, monkeypatch):
    splits = []
    evaluate_split = trainer.evaluate_split

    def spy(model, manifest, root, split, **kwargs):
        splits.append(split)
        return evaluate_split(model, manifest, root, split, **kwargs)

    monkeypatch.setattr(trainer, "evaluate_split", spy)
    params = project("tune.trials=3")
    summary = tune(params)

    assert splits and set(splits) == {"val"}  # every score a trial saw came from the validation split
    study = optuna.load_study(study_name=summary["study"], storage="sqlite:///tuning/optuna.db")
    trials = study.get_trials()
    assert [t.number for t in trials] == [0, 1, 2] and all(t.state in FINISHED for t in trials)
    assert trials[0].user_attrs[BASELINE_ATTR] and trials[0].params == {
        "memory.method": "xbm", "memory.size": 1.0, "memory.add_batch_loss": True, LAMBDA: 0.01,
        "memory.kalman.gain_interval": 100}
    assert all(set(t.intermediate_values) == {1} for t in trials)  # epoch 1 reported (the one epoch)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    best = max(complete, key=lambda t: t.value)
    assert summary["best"]["trial"] == best.number and summary["best"]["value"] == best.value

    tuned = yaml.safe_load(Path("params.tuned.yaml").read_text())
    if LAMBDA in best.params:
        assert tuned["memory"]["kalman"]["r"] == best.params[LAMBDA] and tuned["memory"]["kalman"]["q"] == 1.0
    assert tuned["memory"]["size"] == best.params["memory.size"]
    merged = Path("params.yaml")
    shutil.copy(ROOT / "params.yaml", merged)
    from xbn.tuning import apply_tuned

    apply_tuned(merged, summary["best"]["overrides"])
    assert load_params(merged).memory.kalman.gain_interval == best.params["memory.kalman.gain_interval"]

    written = json.loads(Path("tuning/summary.json").read_text())
    assert written["best"]["trial"] == best.number
    assert written["memory_verdict"].startswith(("A memory ", "No complete trial"))
    assert Path("tuning/plots/optimization_history.png").stat().st_size > 0
    assert not Path("models").exists()  # trials never write the pipeline's model
    for t in trials:
        folder = Path("tuning") / summary["study"] / f"trial_{t.number}"
        assert (folder / "metrics/train_epochs.csv").exists() and not (folder / "models").exists()

    client = MlflowClient(params.tracking.uri)
    parent = client.get_run(summary["mlflow_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.metrics["best_val_recall_at_1"] == best.value
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"params.tuned.yaml", "summary.json", "plots"} <= artifacts
    runs = child_runs(params, summary["mlflow_run_id"])
    by_number = {int(r.data.tags["optuna.trial_number"]): r for r in runs}
    assert sorted(by_number) == [0, 1, 2]
    for t in trials:
        run = by_number[t.number]
        assert run.data.tags["optuna.state"] == t.state.name
        assert [m.step for m in client.get_metric_history(run.info.run_id, "val_recall_at_1")] == [1]

    # Again with a larger budget: the same study and run go on, and only the missing trial runs.
    again = tune(project("tune.trials=4"))
    assert again["study"] == summary["study"] and again["trials"]["total"] == 4
    assert again["mlflow_run_id"] == summary["mlflow_run_id"]
    assert len(child_runs(params, summary["mlflow_run_id"])) == 4


def test_a_weak_trial_is_pruned_at_its_epoch_and_its_run_says_so(project, tmp_path):
    from xbn.tracking.tuning import StudyTracker

    base = project("tune.include_current=false")
    params_file = tmp_path / "base.yaml"
    params_file.write_text(yaml.safe_dump(base.model_dump(mode="json")))
    # R@1 never reaches 1.01: the pruner stops every trial at its first report.
    session = open_study(base, resolve_storage(base.tune, 1), seed=0,
                         pruner=optuna.pruners.ThresholdPruner(lower=1.01))
    tracker = StudyTracker.open(base, session.name)
    objective = Objective(params_file, base, SearchSpace.from_config(base.tune), tmp_path / "trials", tracker)
    assert run_worker(session, objective, trials=1) == 1

    trial = session.study.get_trials()[0]
    assert trial.state == TrialState.PRUNED and list(trial.intermediate_values) == [1]
    (run,) = child_runs(base, tracker.run_id)
    assert run.info.status == "KILLED" and run.data.tags["optuna.state"] == "PRUNED"
    assert not (tmp_path / "trials/trial_0/models").exists()


def test_runs_of_lost_trials_end_failed_even_when_their_worker_ended_them(project):
    """A worker killed after its trial's run ended FINISHED and before Optuna was told: Optuna fails the trial
    (heartbeats), and the study's report marks its run FAILED too. A run left RUNNING is closed FAILED; a
    completed trial's run is left as it was."""
    from xbn.tracking.tuning import StudyTracker

    base = project()
    tracker = StudyTracker.open(base, "lost")
    runs = [tracker.start_trial(n, {"memory.q": 0.1}, base) for n in range(3)]
    runs[0].end("COMPLETE", 0.5)  # ended by the worker, then the worker died
    runs[2].end("COMPLETE", 0.6)  # a trial that completed
    closed = tracker.close_lost_trials([0, 1])
    assert sorted(closed) == sorted([runs[0].run_id, runs[1].run_id])
    status = {int(r.data.tags["optuna.trial_number"]): (r.info.status, r.data.tags["optuna.state"])
              for r in child_runs(base, tracker.run_id)}
    assert status == {0: ("FAILED", "FAIL"), 1: ("FAILED", "FAIL"), 2: ("FINISHED", "COMPLETE")}
