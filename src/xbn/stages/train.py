"""Stage `train`: the training loop (`xbn.training.fit`), tracked as the pipeline's MLflow run.

Under torchrun (`xbn train --nproc N` starts `python -m xbn.cli train` N times; `--nnodes M` on each of M
machines) every process joins the process group here, checks that it trains from the same params, manifest
and checkpoint as rank 0 (`check_ranks_agree`), and trains its slice of each global batch; the global rank 0
alone tracks the run in MLflow, writes the checkpoints and metrics (the DVC outputs) and returns the summary,
the other ranks run the bare loop whose collectives pair with rank 0's.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

from xbn.config import ConfigError, Params
from xbn.models import InitialWeights, load_embedder
from xbn.training import EpochCallback, fit
from xbn.training.replicas import check_ranks_agree
from xbn.utils import distributed
from xbn.utils.integrity import verify_sidecar
from xbn.utils.io import file_digest
from xbn.utils.runtime import resolve_device

log = logging.getLogger(__name__)


class TrainingResult(dict):
    """What `train` returns: the training report (`metrics/train.json`'s content; a dict, as it always was) and
    where the training left its outputs, with the trained model on demand:

        result = train(params)
        result["best_val_recall@1"], result.best_epoch, result.model_path
        model = result.load_model()  # the selected epoch's embedder, sha256-checked, in eval mode
    """

    def __init__(self, report: dict, params: Params):
        super().__init__(report)
        self.params = params
        self.model_path = Path(params.train.checkpoint_dir) / "model.pt"  # the epoch chosen on validation
        self.checkpoint_path = Path(params.train.checkpoint_dir) / "last.pt"  # resumable: `train(..., resume=True)`
        self.metrics_dir = Path(params.train.metrics_dir)  # train.json, train_steps.csv, train_epochs.csv

    @property
    def best_epoch(self) -> int:
        return int(self["best_epoch"])

    def load_model(self, device: str = "cpu"):
        """The selected epoch's `Embedder` (eval mode), checked against its sha256 sidecar."""
        return load_embedder(self.model_path, map_location=device)[0]


def train(params: Params, resume: bool = False, progress: bool = True, params_file: str = "params.yaml",
          on_epoch: EpochCallback | None = None, flow_run_id: str | None = None) -> TrainingResult:
    """Train the embedder of `params` on `data.manifest` (as `xbn train`): writes `models/model.pt` (the best
    epoch by validation R@1), `models/last.pt` and `metrics/train*.{json,csv}`, logs the run to MLflow when
    `tracking.enabled`, and returns a `TrainingResult` (the report of `metrics/train.json`, the paths, the
    model). `resume`: continue from `models/last.pt`; `progress`: bars on stderr; `on_epoch`: called after each
    epoch with its metrics; `flow_run_id`: the retrain flow run calling (recorded in the checkpoint)."""
    return TrainingResult(_train(params, resume, progress, params_file, on_epoch, flow_run_id), params)


def _train(params: Params, resume: bool, progress: bool, params_file: str, on_epoch: EpochCallback | None,
           flow_run_id: str | None) -> dict:
    with distributed.process_group(resolve_device(params.train.device).type):
        check_ranks_agree(params, resume)
        if distributed.world_size() > 1 and distributed.is_main():
            log.info("rank 0 of %d, on %s, writes %s and %s%s", distributed.world_size(), socket.gethostname(),
                     params.train.checkpoint_dir, params.train.metrics_dir,
                     " and tracks the MLflow run" if params.tracking.enabled else "")
        # A resumed fine-tuning continues from last.pt, which records where its weights started.
        init = None if resume else initial_weights(params)
        if not distributed.is_main():
            return fit(params, resume=resume, progress=False, init=init)
        if not params.tracking.enabled:
            return fit(params, resume=resume, progress=progress, on_epoch=on_epoch, flow_run_id=flow_run_id,
                       init=init)
        return _tracked(params, resume, progress, params_file, on_epoch, flow_run_id, init)


def initial_weights(params: Params) -> InitialWeights | None:
    """The weights `train.init` names, downloaded and sha256-checked: None for `pretrained`; the registry's
    champion (verified against its version's `model_sha256` tag, as serving does); or an xbn model.pt (against
    its sidecar). A ConfigError when there is none, or when its backbone or embedding size differs from the
    params'."""
    init = params.train.init
    if init == "pretrained":
        return None
    if init == "champion":
        from xbn.tracking import Registry

        if not params.tracking.enabled:
            raise ConfigError("train.init=champion reads the registry: it needs tracking.enabled=true")
        registry = Registry(params)
        champion = registry.by_alias("champion")
        if champion is None:
            raise ConfigError(f"train.init=champion, but {params.registry.model_name} has no champion yet: "
                              "train the first version with train.init=pretrained")
        dst = Path(params.train.checkpoint_dir) / "init" / f"v{champion.version}"
        path = registry.checkpoint(champion, dst).path
        weights = InitialWeights(path, "champion", file_digest(path), champion.version)
    else:
        path = Path(init)
        if not path.is_file():
            raise ConfigError(f"train.init={init}: no such file (pretrained, champion or the path of a model.pt)")
        weights = InitialWeights(path, init, verify_sidecar(path))
    weights.check(params.model)
    log.info("fine-tuning %s for %d epochs (train.init=%s)", weights.describe(), params.train.epochs, init)
    return weights


def _tracked(params: Params, resume: bool, progress: bool, params_file: str, on_epoch: EpochCallback | None,
             flow_run_id: str | None, init: InitialWeights | None) -> dict:
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

        summary = fit(params, resume=resume, progress=progress, on_epoch=both, flow_run_id=flow_run_id, init=init)
        log_training(params, run, params_file)
    return summary


__all__ = ["initial_weights", "train"]
