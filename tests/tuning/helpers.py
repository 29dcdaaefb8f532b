"""Helpers for the tuning tests."""

from __future__ import annotations

from mlflow.tracking import MlflowClient


def child_runs(params, parent_run_id: str) -> list:
    client = MlflowClient(params.tracking.uri)
    experiment = client.get_experiment_by_name(params.tracking.experiment)
    return client.search_runs([experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}'")
