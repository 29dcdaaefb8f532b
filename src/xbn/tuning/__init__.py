"""Optuna tuning: the search space, storages and the exact trial budget, the objective and workers, the
study's outputs. `xbn.stages.tune` puts them together; MLflow stays behind `xbn.tracking.tuning`."""

from xbn.tuning.report import (
    apply_tuned,
    importances,
    set_yaml_values,
    summarize,
    tuned_values,
    write_plots,
    write_tuned,
)
from xbn.tuning.space import LAMBDA, SearchSpace, as_overrides
from xbn.tuning.storage import StorageSpec, open_storage, resolve_storage, study_lock
from xbn.tuning.study import (
    BASELINE_ATTR,
    MLFLOW_RUN_ATTR,
    OBJECTIVE,
    WORKER_ATTR,
    Objective,
    StudySession,
    fail_lost_trials,
    fail_trials_of,
    fingerprint,
    make_pruner,
    open_study,
    run_worker,
    study_name,
    wait_for_running,
    worker_id,
)

__all__ = [
    "BASELINE_ATTR",
    "LAMBDA",
    "MLFLOW_RUN_ATTR",
    "OBJECTIVE",
    "WORKER_ATTR",
    "Objective",
    "SearchSpace",
    "StorageSpec",
    "StudySession",
    "apply_tuned",
    "as_overrides",
    "fail_lost_trials",
    "fail_trials_of",
    "fingerprint",
    "importances",
    "make_pruner",
    "open_storage",
    "open_study",
    "resolve_storage",
    "run_worker",
    "set_yaml_values",
    "study_lock",
    "study_name",
    "summarize",
    "tuned_values",
    "wait_for_running",
    "worker_id",
    "write_plots",
    "write_tuned",
]
