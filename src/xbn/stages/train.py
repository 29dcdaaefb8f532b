"""Stage `train`: the training loop (`xbn.training.trainer`), tracked as the pipeline's MLflow run."""

from __future__ import annotations

from xbn.config import Params
from xbn.training.trainer import EpochCallback
from xbn.training.trainer import train as fit


def train(params: Params, resume: bool = False, progress: bool = True, params_file: str = "params.yaml",
          on_epoch: EpochCallback | None = None, flow_run_id: str | None = None) -> dict:
    """`flow_run_id`: the retrain flow run calling (recorded in the checkpoint; see `Trainer`)."""
    if not params.tracking.enabled:
        return fit(params, resume=resume, progress=progress, on_epoch=on_epoch, flow_run_id=flow_run_id)
    from xbn.tracking import epoch_logger, log_training, pipeline_run, tracking_uri
    from xbn.tracking.services import check_reachable

    check_reachable(tracking_uri(params))  # fail in seconds, before any training, if the store is down
    # A fresh training starts the execution's run; a resumed one continues the run it was part of.
    with pipeline_run(params, "train", new=not resume) as run:
        log_epoch = epoch_logger(run)

        def both(epoch: int, row: dict) -> None:
            log_epoch(epoch, row)
            if on_epoch:
                on_epoch(epoch, row)

        summary = fit(params, resume=resume, progress=progress, on_epoch=both, flow_run_id=flow_run_id)
        log_training(params, run, params_file)
    return summary


__all__ = ["train"]
