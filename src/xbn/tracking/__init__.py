"""The tracking boundary: every MLflow call of the project goes through this package.

Runs (`pipeline_run`, `epoch_logger`, `log_training`, `log_evaluation`, `log_model`), the registry
(`Registry`, `ModelVersionInfo`), fingerprints of data, params and model files, and the pictures a run carries
(`retrieval_grid`, `plot_training`). The rest of the package never imports mlflow.
"""

from xbn.tracking.fingerprints import data_hash, file_digest, git_commit, params_hash
from xbn.tracking.plots import plot_training, retrieval_grid, retrieval_grid_from_embeddings
from xbn.tracking.registry import ModelVersionInfo, Registry
from xbn.tracking.runs import (
    PARENT_RUN_ENV,
    RETRIEVAL_GRID,
    RUN_ID_FILE,
    PipelineRun,
    current_run_id,
    epoch_logger,
    log_evaluation,
    log_gate,
    log_model,
    log_training,
    pipeline_run,
    run_summary,
    scores_of,
    tracking_uri,
)

__all__ = [
    "PARENT_RUN_ENV",
    "RETRIEVAL_GRID",
    "RUN_ID_FILE",
    "ModelVersionInfo",
    "PipelineRun",
    "Registry",
    "current_run_id",
    "data_hash",
    "epoch_logger",
    "file_digest",
    "git_commit",
    "log_evaluation",
    "log_gate",
    "log_model",
    "log_training",
    "params_hash",
    "pipeline_run",
    "plot_training",
    "retrieval_grid",
    "retrieval_grid_from_embeddings",
    "run_summary",
    "scores_of",
    "tracking_uri",
]
