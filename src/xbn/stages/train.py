"""Stage `train`: the training loop (`xbn.training.fit`), tracked as the pipeline's MLflow run.

Under torchrun (`xbn train --nproc N` starts `python -m xbn.cli train` N times) every process joins the
process group here and trains its slice of each global batch; rank 0 alone tracks the run in MLflow, writes the
checkpoints and metrics and returns the summary, the other ranks run the bare loop whose collectives pair with
rank 0's.
"""

from __future__ import annotations

from xbn.config import Params
from xbn.training import EpochCallback, fit
from xbn.utils import distributed
from xbn.utils.runtime import resolve_device


def train(params: Params, resume: bool = False, progress: bool = True, params_file: str = "params.yaml",
          on_epoch: EpochCallback | None = None, flow_run_id: str | None = None) -> dict:
    """`flow_run_id`: the retrain flow run calling (recorded in the checkpoint; see `Trainer`)."""
    with distributed.process_group(resolve_device(params.train.device).type):
        if not distributed.is_main():
            return fit(params, resume=resume, progress=False)
        if not params.tracking.enabled:
            return fit(params, resume=resume, progress=progress, on_epoch=on_epoch, flow_run_id=flow_run_id)
        return _tracked(params, resume, progress, params_file, on_epoch, flow_run_id)


def _tracked(params: Params, resume: bool, progress: bool, params_file: str, on_epoch: EpochCallback | None,
             flow_run_id: str | None) -> dict:
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
