"""MLflow for tuning studies: one run per study, one child run per trial.

Runs are addressed by id through `MlflowClient` (nothing is made MLflow's active run), so a worker can track
trials while another run is active in its process, and a child can be created while the study's run is not
running (a worker that joins late). Nesting is MLflow's `mlflow.parentRunId` tag, which the UI and
`search_runs` read. Metric keys follow `runs.py` (`val_recall@1` is logged as `val_recall_at_1`).
A trial's run ends FINISHED, KILLED when pruned, or FAILED; its tag `optuna.state` names the Optuna state.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.entities import Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from xbn.config import Params, flatten
from xbn.tracking.runs import as_metrics, as_tags, tracking_uri
from xbn.tracking.services import mask_secrets

log = logging.getLogger(__name__)

STUDY_TAG, TRIAL_TAG, STATE_TAG = "optuna.study", "optuna.trial_number", "optuna.state"
_RUN_STATUS = {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "FAIL": "FAILED"}
_MAX_PARAMS = 100  # per log_batch call


@dataclass(frozen=True)
class TrialRun:
    client: MlflowClient
    run_id: str

    def log_epoch(self, epoch: int, row: Mapping[str, Any]) -> None:
        values = {k: v for k, v in row.items() if k != "epoch"}
        self.client.log_batch(self.run_id, metrics=as_metrics(values, step=epoch))

    def end(self, state: str, value: float | None = None) -> None:
        if value is not None:
            self.client.log_batch(self.run_id, metrics=as_metrics({"objective": value}, step=0))
        self.client.set_tag(self.run_id, STATE_TAG, state)
        self.client.set_terminated(self.run_id, _RUN_STATUS.get(state, "FAILED"))


class StudyTracker:
    """The study's run (`run_id`) and the child runs of its trials."""

    def __init__(self, params: Params, study_name: str, run_id: str):
        self.client = MlflowClient(tracking_uri(params))
        self.study_name, self.run_id = study_name, run_id
        self.experiment_id = self.client.get_run(run_id).info.experiment_id

    @classmethod
    def open(cls, params: Params, study_name: str, run_id: str | None = None,
             tags: Mapping[str, str] | None = None) -> StudyTracker | None:
        """Join the study's run `run_id` (reopened if it had ended), or start it when `run_id` is None.
        None when `run_id` is not in this tracking store (a worker on another machine tracking elsewhere)."""
        uri = tracking_uri(params)
        client = MlflowClient(uri)
        if run_id is None:
            experiment_id = _experiment_id(client, params.tracking.experiment)
            run = client.create_run(experiment_id, run_name=f"tune {study_name}",
                                    tags={STUDY_TAG: study_name, "xbn.stage": "tune", **(tags or {})})
            _log_params(client, run.info.run_id, flatten(params))
            return cls(params, study_name, run.info.run_id)
        try:
            run = client.get_run(run_id)
        except MlflowException:
            log.warning("the study's MLflow run %s is not in %s: this worker's trials are not tracked (point "
                        "MLFLOW_TRACKING_URI at the study's tracking server)", run_id, uri)
            return None
        if run.info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
        return cls(params, study_name, run_id)

    def start_trial(self, number: int, sampled: Mapping[str, Any], params: Params) -> TrialRun:
        run = self.client.create_run(self.experiment_id, run_name=f"trial {number}", tags={
            MLFLOW_PARENT_RUN_ID: self.run_id, STUDY_TAG: self.study_name, TRIAL_TAG: str(number),
            "xbn.stage": "tune-trial", "xbn.worker": f"{socket.gethostname()}:{os.getpid()}"})
        _log_params(self.client, run.info.run_id, {**flatten(params), **sampled})
        return TrialRun(self.client, run.info.run_id)

    def log_study(self, metrics: Mapping[str, Any], tags: Mapping[str, Any], files: Iterable[Path],
                  plots: Iterable[Path]) -> None:
        self.client.log_batch(self.run_id, metrics=as_metrics(metrics, step=0), tags=as_tags(tags))
        for path in files:
            self.client.log_artifact(self.run_id, str(path))
        for path in plots:
            self.client.log_artifact(self.run_id, str(path), "plots")

    def close_lost_trials(self, numbers: Iterable[int]) -> list[str]:
        """Mark FAILED the child runs of trials Optuna holds as failed: left RUNNING by a worker that died, or
        ended FINISHED by one that died after its trial's run ended and before Optuna was told (the trial then
        counts as lost, and its run must not say otherwise)."""
        lost, closed = {str(n) for n in numbers}, []
        for run in self.child_runs():
            if run["status"] != "FAILED" and run["tags"].get(TRIAL_TAG) in lost:
                TrialRun(self.client, run["run_id"]).end("FAIL")
                closed.append(run["run_id"])
        return closed

    def finish(self, ok: bool = True) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")

    def child_runs(self) -> list[dict[str, Any]]:
        """The trials' runs: tags, status and metrics (for the summary and tests)."""
        query = f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{self.run_id}'"
        runs = self.client.search_runs([self.experiment_id], query, max_results=10_000)
        return [{"run_id": r.info.run_id, "status": r.info.status, "tags": dict(r.data.tags),
                 "metrics": dict(r.data.metrics)} for r in runs]


def _experiment_id(client: MlflowClient, name: str) -> str:
    if experiment := client.get_experiment_by_name(name):
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:  # another worker created it first
        experiment = client.get_experiment_by_name(name)
        assert experiment is not None
        return experiment.experiment_id


def _log_params(client: MlflowClient, run_id: str, values: Mapping[str, Any]) -> None:
    params = [Param(k, mask_secrets(str(v))[:6000]) for k, v in values.items()]  # tune.storage may hold one
    for start in range(0, len(params), _MAX_PARAMS):
        client.log_batch(run_id, params=params[start:start + _MAX_PARAMS])
