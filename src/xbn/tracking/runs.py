"""MLflow runs: one run per pipeline execution, which the stages (separate processes under DVC) join.

Which run a stage logs to:
1. `$XBN_PARENT_RUN_ID` when set, or the run already active in this process: an orchestrator (a Prefect
   flow, a tuning study, a script) owns the run.
2. Otherwise the training stage starts a new run (`pipeline_run(..., new=True)`) and writes its id to
   `reports/run_id`; the later stages (evaluate, register) resume the run named there. In dvc.yaml,
   `reports/run_id` is an (uncached) output of `train` and a dependency of `evaluate` and `register`, so a
   `dvc repro` that retrains gives exactly one new run, and a repro that only re-evaluates adds to the run
   of the model it evaluates.
MLflow params cannot change once logged: a resumed run gets only the params it lacks, and the keys whose value
differs from the one logged are named in the run tag `xbn.params_changed` (with a warning) instead of failing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import numbers
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
import yaml
from mlflow.data.pandas_dataset import from_pandas  # mlflow.data registers it at import: untyped there
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from xbn.config import Params, flatten
from xbn.data.snapshot import DATA_FILES, DATA_RECORD, DataSnapshot, current_record
from xbn.tracking import pyfunc
from xbn.tracking.fingerprints import data_hash, file_digest, git_commit, params_hash
from xbn.tracking.plots import plot_evaluation, plot_gate, plot_training
from xbn.tracking.services import Retrying, account_to_environment, mask_secrets, redact
from xbn.utils.io import write_text

log = logging.getLogger(__name__)

PARENT_RUN_ENV = "XBN_PARENT_RUN_ID"
RUN_ID_FILE = Path("reports/run_id")
PLOTS_DIR = Path("plots")
RETRIEVAL_GRID = PLOTS_DIR / "retrieval_grid.png"
EVALUATION_PLOT = PLOTS_DIR / "evaluation.png"  # recall@k and the spectrum (`plot_evaluation`)
GATE_PLOT = PLOTS_DIR / "gate_bootstrap.png"  # the promotion gate's bootstrap distribution (`log_gate`)
MODEL_NAME = "model"  # the pyfunc's name inside the run
MODEL_URI_TAG, MODEL_SHA_TAG = "xbn.model_uri", "model_sha256"
DATA_ARTIFACTS = "data"  # the run's data snapshot: data.json, data_files.parquet, <folder>.dvc
DATA_MD5_TAG = "data_md5"  # DVC's md5 of data.root ("unversioned" with data.version: none)


@dataclass(frozen=True)
class PipelineRun:
    """The run a stage logs to; a plain handle, so callers never touch MLflow objects."""

    run_id: str
    experiment_id: str
    tracking_uri: str
    artifact_uri: str
    resumed: bool


def tracking_uri(params: Params) -> str:
    """`$MLFLOW_TRACKING_URI` (a server in production) wins over `tracking.uri` (local SQLite by default); a
    server's account embedded in it goes to the environment (`account_to_environment`)."""
    return account_to_environment(os.environ.get("MLFLOW_TRACKING_URI") or params.tracking.uri)


def configure(params: Params) -> str:
    """Point MLflow at the store and experiment of `params`; returns the tracking URI."""
    uri = tracking_uri(params)
    # MLflow prints "View run <name> at: <tracking URI>/#/..." to stdout as a run ends, credentials and all (a
    # worker's stdout is a log someone keeps); xbn logs its runs itself, masked.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    # MLflow copies the URI into $MLFLOW_TRACKING_URI, which `tracking_uri` reads as the user's choice: a second
    # configure in the same process (another params, a library caller, the next test) would then get this store
    # whatever its own tracking.uri said. The environment is left as the user (or the parent process) set it.
    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before
    mlflow.set_experiment(params.tracking.experiment)
    return uri


def metric_key(name: str) -> str:
    """MLflow metric and tag keys cannot hold '@': `recall@1` is logged as `recall_at_1`."""
    return name.replace("@", "_at_")


def metric_name(key: str) -> str:
    return key.replace("_at_", "@")


def current_run_id() -> str | None:
    """The run this pipeline execution logs to: `$XBN_PARENT_RUN_ID`, else `reports/run_id`, else None."""
    return os.environ.get(PARENT_RUN_ENV, "").strip() or _run_id_in_file()


@contextlib.contextmanager
def pipeline_run(
    params: Params, run_name: str | None = None, tags: Mapping[str, str] | None = None, *, new: bool = False
) -> Iterator[PipelineRun]:
    """Start or resume the pipeline's run (see the module docstring), log the flattened params and the tags
    (`git_commit`, `data_hash`, `params_hash` and `tags`), and make it MLflow's active run inside the block.
    An exception in the block marks the run FAILED."""
    uri = configure(params)
    client = MlflowClient(uri)
    from_env = os.environ.get(PARENT_RUN_ENV, "").strip()
    active = mlflow.active_run()  # an orchestrator running the stages in this process holds its run open
    run_id = from_env or (active.info.run_id if active else None) or (None if new else current_run_id())
    if run_id and not _run_exists(client, run_id):
        if from_env:
            raise ValueError(f"{PARENT_RUN_ENV}={run_id} names no run in the tracking store {uri}")
        log.warning("%s names run %s, which is not in %s: starting a new run", RUN_ID_FILE, run_id, uri)
        run_id = None
    with contextlib.ExitStack() as stack:
        if not (active and active.info.run_id == run_id):  # already active in this process: join it as is
            active = stack.enter_context(
                mlflow.start_run(run_id=run_id, run_name=None if run_id else run_name,
                                 log_system_metrics=_system_metrics_available())
            )
        info = active.info
        run = PipelineRun(info.run_id, info.experiment_id, uri, info.artifact_uri, resumed=run_id is not None)
        if _run_id_in_file() != run.run_id:  # rewritten only on change: the file is a DVC output
            write_text(RUN_ID_FILE, run.run_id + "\n")
        _log_params(client, run.run_id, {**flatten(params), "loss_composition": params.loss_composition})
        base = {"git_commit": git_commit(), "data_hash": data_hash(params),
                "params_hash": params_hash(params)}
        client.log_batch(run.run_id, tags=as_tags({**base, **(tags or {})}))
        # Once per pipeline execution on the console: the later stages join the same run.
        log.log(logging.DEBUG if run.resumed else logging.INFO, "MLflow run %s (%s) in %s", run.run_id,
                "resumed" if run.resumed else "new", mask_secrets(uri))
        yield run


def epoch_logger(run: PipelineRun) -> Callable[[int, dict], None]:
    """The trainer's `on_epoch` callback: logs each numeric value of an epoch row with step=epoch.

    Transient store errors are retried; if the store stays down the row is skipped with a warning rather than
    stopping the training (`log_training` logs the epochs the store missed from train_epochs.csv)."""
    client = Retrying(MlflowClient(run.tracking_uri))

    def log_epoch(epoch: int, row: dict) -> None:
        values = {k: v for k, v in row.items() if k != "epoch"}
        try:
            client.log_batch(run.run_id, metrics=as_metrics(values, step=epoch))
        except Exception as exc:  # noqa: BLE001 - the checkpoint and metrics files have the row
            log.warning("epoch %d metrics not logged to MLflow (%s); they are sent again when the stage "
                        "ends", epoch, mask_secrets(str(exc))[:300])

    return log_epoch


def log_training(params: Params, run: PipelineRun, params_file: str | Path = "params.yaml") -> dict[str, Any]:
    """Log what the train stage produced: the params file and the resolved params, the summary metrics
    (`train/...`), per-epoch rows the callback did not log (epoch 0, the untrained score), per-step
    diagnostics (`step/...`, step=iteration), the training plots, the validation report if present, and the
    model."""
    client = Retrying(MlflowClient(run.tracking_uri))
    metrics_dir = Path(params.train.metrics_dir)
    summary_file = metrics_dir / "train.json"
    if summary_file.exists():
        summary = json.loads(summary_file.read_text())
        client.log_batch(run.run_id, metrics=as_metrics({f"train/{k}": v for k, v in summary.items()}, step=0))
        client.log_artifact(run.run_id, str(summary_file), "metrics")
    _log_series(client, run.run_id, metrics_dir / "train_epochs.csv", "epoch", prefix="")
    _log_series(client, run.run_id, metrics_dir / "train_steps.csv", "iteration", prefix="step/")
    if Path(params_file).exists():
        text = Path(params_file).read_text()
        if mask_secrets(text) != text:  # a password in a URI: record the file with it masked
            client.log_text(run.run_id, mask_secrets(text), Path(params_file).name)
        else:
            client.log_artifact(run.run_id, str(params_file))
    client.log_dict(run.run_id, redact(params.model_dump(mode="json")), "params.resolved.yaml")
    plots = plot_training(metrics_dir / "train_epochs.csv", metrics_dir / "train_steps.csv", PLOTS_DIR)
    for png in plots:
        client.log_artifact(run.run_id, str(png), "plots")
    for report in (params.validate.report, params.validate.report_text):
        if Path(report).exists():
            client.log_artifact(run.run_id, report, "validation")
    log_data(params, run)
    return {"model_uri": log_model(params, run), "plots": [str(p) for p in plots]}


def log_data(params: Params, run: PipelineRun) -> DataSnapshot | None:
    """Record the data snapshot the run trained on (`xbn.data.snapshot`), when there is one for this data: the
    per-image table as the run's MLflow dataset input (source: the manifest; digest: DVC's md5), and under
    `data/` the `.dvc` record (what `xbn data restore` writes back), the snapshot's JSON and the table itself."""
    found = current_record(params)
    if found is None:
        return None
    client = Retrying(MlflowClient(run.tracking_uri))
    files = pd.read_parquet(DATA_FILES)
    dataset = from_pandas(files, source=str(Path(params.data.manifest).resolve()),
                          name=f"{params.data.dataset}:{Path(params.data.root).name}",
                          digest=(found.md5 or found.manifest_md5)[:32])
    mlflow.log_input(dataset, context="training")  # the active run: the stage's `with pipeline_run(...)`
    client.log_artifact(run.run_id, str(DATA_RECORD), DATA_ARTIFACTS)
    client.log_artifact(run.run_id, str(DATA_FILES), DATA_ARTIFACTS)
    if record := found.dvc_record():
        client.log_text(run.run_id, yaml.safe_dump(record, sort_keys=False),
                        f"{DATA_ARTIFACTS}/{record['outs'][0]['path']}.dvc")
    client.set_tag(run.run_id, DATA_MD5_TAG, found.md5 or "unversioned")
    return found


def log_files(run: PipelineRun, paths: list[str | Path], artifact_dir: str) -> None:
    """Log the files of `paths` that exist under `artifact_dir` of the run (reports such as the drift's)."""
    client = Retrying(MlflowClient(run.tracking_uri))
    for path in paths:
        if Path(path).exists():
            client.log_artifact(run.run_id, str(path), artifact_dir)


def log_evaluation(params: Params, run: PipelineRun, grid_png: str | Path | None = None) -> dict[str, float]:
    """Log `eval.output`'s metrics (each nested set, such as the untrained baseline or the test-time MPN's,
    as `untrained/...`, `mpn/...`), the file itself, and the
    retrieval grid (`grid_png`, else `plots/retrieval_grid.png` when the evaluate stage drew one).
    Returns the test metrics under their own names (`recall@1`, ...)."""
    client = Retrying(MlflowClient(run.tracking_uri))
    results = json.loads(Path(params.eval.output).read_text())
    scores = scores_of(results)
    untrained = {f"{name}/{k}": v for name, nested in results.items() if isinstance(nested, dict)
                 for k, v in nested.items()}
    counts = {f"eval/{k}": v for k, v in results.items() if k not in scores}
    client.log_batch(run.run_id, metrics=as_metrics({**scores, **untrained, **counts}, step=0))
    client.log_artifact(run.run_id, params.eval.output, "metrics")
    grid = Path(grid_png) if grid_png else RETRIEVAL_GRID
    if grid.exists():
        client.log_artifact(run.run_id, str(grid), "plots")
    folder = Path(params.eval.output).parent
    if drawn := plot_evaluation(folder / "recall_at_k.csv", folder / "spectrum.csv", EVALUATION_PLOT):
        client.log_artifact(run.run_id, str(drawn), "plots")
    return scores


def log_gate(run: PipelineRun, comparison: Any, min_improvement: float) -> None:
    """Draw the gate's bootstrap distribution (`plot_gate`) and log it on the challenger's run, where the model
    card links it. A figure is not worth a failed registration: a store error is a warning."""
    if comparison is None or comparison.means is None:
        return
    try:
        png = plot_gate(comparison.means, comparison.difference, comparison.low, comparison.high, min_improvement,
                        f"gate: {comparison.interval()} vs v{comparison.champion_version}", GATE_PLOT)
        Retrying(MlflowClient(run.tracking_uri)).log_artifact(run.run_id, str(png), "plots")
    except Exception as exc:  # noqa: BLE001 - the decision and the card do not depend on the picture
        log.warning("the gate's figure was not logged (%s)", mask_secrets(str(exc))[:300])


def scores_of(results: Mapping[str, Any]) -> dict[str, float]:
    """The quality metrics of an eval.json: its top-level numbers less bookkeeping (the epoch the model was
    selected at, `num_queries`, `num_references`, `queries_without_match`)."""
    return {k: float(v) for k, v in results.items()
            if _is_number(v) and k != "epoch" and not k.startswith(("num_", "queries_"))}


def log_model(params: Params, run: PipelineRun, checkpoint: str | Path | None = None) -> str:
    """Log `models/model.pt` as the run's pyfunc model and return its URI. Idempotent: when the run already
    holds a model with the checkpoint's sha256, that model's URI is returned and nothing is logged."""
    checkpoint = Path(checkpoint or Path(params.train.checkpoint_dir) / "model.pt")
    if not checkpoint.exists():
        raise FileNotFoundError(f"no trained model at {checkpoint}: run `xbn train` first")
    client = MlflowClient(run.tracking_uri)
    sha = file_digest(checkpoint)
    tags = client.get_run(run.run_id).data.tags
    if tags.get(MODEL_SHA_TAG) == sha and tags.get(MODEL_URI_TAG):
        return tags[MODEL_URI_TAG]
    active = mlflow.active_run()
    if not (active and active.info.run_id == run.run_id):
        raise RuntimeError("log_model logs to the active run: call it inside `with pipeline_run(...)`")
    with tempfile.TemporaryDirectory(prefix="xbn-code-") as code, _pins_taken_as_installed():
        info = _log_pyfunc(params, checkpoint, sha, pyfunc.package_code(Path(code)))
    client.log_batch(run.run_id, tags=as_tags({MODEL_URI_TAG: info.model_uri, MODEL_SHA_TAG: sha}))
    return info.model_uri


@contextlib.contextmanager
def _pins_taken_as_installed() -> Iterator[None]:
    """MLflow's log_model checks each pin against the environment (a warning only), twice: as it saves the model
    and as it loads it back to validate the input example. Each maps every installed distribution's files to its
    modules: about 3 s of the 4 s `register` took, in a venv with torch. Our pins are read from this very
    environment (`pyfunc.pip_requirements`), so the check cannot find a mismatch. The name is MLflow's internal:
    where a release moves it, nothing is skipped."""
    import mlflow.pyfunc
    from mlflow.utils import environment

    name = "warn_dependency_requirement_mismatches"
    holders = [module for module in (environment, mlflow.pyfunc) if hasattr(module, name)]
    checks = [getattr(module, name) for module in holders]
    for module in holders:
        setattr(module, name, lambda requirements: None)
    try:
        yield
    finally:
        for module, check in zip(holders, checks):
            setattr(module, name, check)


def _log_pyfunc(params: Params, checkpoint: Path, sha: str, code: Path):
    return mlflow.pyfunc.log_model(
        name=MODEL_NAME,
        python_model=str(pyfunc.MODEL_CODE),
        code_paths=[str(code)],  # xbn itself: the model loads where xbn is not installed
        artifacts={pyfunc.CHECKPOINT_ARTIFACT: str(checkpoint)},
        model_config=pyfunc.model_config(params, sha),
        signature=pyfunc.signature(),
        input_example=pyfunc.input_example(params.data.image_size),
        pip_requirements=pyfunc.pip_requirements(),
        metadata={"image_size": params.data.image_size, "embedding_dim": params.model.embedding_dim,
                  "backbone": params.model.backbone, **_normalization(checkpoint)},
        tags={MODEL_SHA_TAG: sha},
    )


def run_summary(run_id: str, params: Params) -> dict[str, Any]:
    """A run's metrics (own names), tags and artifact URI, for the model card."""
    client = MlflowClient(tracking_uri(params))
    run = client.get_run(run_id)
    return {
        "metrics": {metric_name(k): v for k, v in run.data.metrics.items()},
        "tags": dict(run.data.tags),
        "artifact_uri": run.info.artifact_uri,
        "experiment_id": run.info.experiment_id,
        "artifacts": [f.path for f in client.list_artifacts(run_id, "plots")],
    }


# -- helpers -----------------------------------------------------------------------------------------------
def _normalization(checkpoint: Path) -> dict[str, list[float]]:
    # Callers of the tensor entry point (`embed_tensors`) normalize as training did: publish the mean/std.
    import torch

    data_config = torch.load(checkpoint, map_location="cpu", weights_only=True).get("data_config", {})
    return {k: [float(x) for x in data_config[k]] for k in ("mean", "std") if k in data_config}


def _run_id_in_file() -> str | None:
    return (RUN_ID_FILE.read_text().strip() or None) if RUN_ID_FILE.exists() else None


def _run_exists(client: MlflowClient, run_id: str) -> bool:
    try:
        client.get_run(run_id)
    except MlflowException:
        return False
    return True


def _system_metrics_available() -> bool:
    # CPU, memory, disk and network come from psutil (offline); GPU metrics need pynvml, skipped without it.
    return importlib.util.find_spec("psutil") is not None


def _log_params(client: MlflowClient, run_id: str, flat: Mapping[str, Any]) -> None:
    logged = client.get_run(run_id).data.params
    values = {k: mask_secrets(str(v)) for k, v in flat.items()}  # no password reaches the store
    changed = sorted(k for k, v in values.items() if k in logged and logged[k] != v)
    client.log_batch(run_id, params=[Param(k, v) for k, v in values.items() if k not in logged])
    if changed:
        log.warning("run %s was started with other values of %s; MLflow keeps the first ones",
                    run_id, changed)
        client.set_tag(run_id, "xbn.params_changed", ",".join(changed)[:5000])


def _log_series(client: MlflowClient | Retrying, run_id: str, csv: Path, step_col: str, prefix: str) -> None:
    """Log each numeric column of a CSV with step=`step_col`, skipping steps already logged under that key."""
    if not csv.exists() or csv.stat().st_size == 0:
        return
    import pandas as pd

    frame = pd.read_csv(csv)
    if step_col not in frame:
        return
    metrics = []
    for col in frame.columns.drop(step_col):
        if col == "epoch" or not pd.api.types.is_numeric_dtype(frame[col]):
            continue
        key = metric_key(prefix + col)
        seen = {m.step for m in client.get_metric_history(run_id, key)}
        metrics += [m for step, value in zip(frame[step_col], frame[col]) if int(step) not in seen
                    for m in as_metrics({key: value}, step=int(step))]
    client.log_batch(run_id, metrics=metrics)


def as_metrics(values: Mapping[str, Any], step: int) -> list[Metric]:
    """MLflow metrics for `log_batch`: the numbers of `values`, NaNs and non-numbers left out."""
    now = int(time.time() * 1000)
    return [Metric(metric_key(k), float(v), now, step) for k, v in values.items()
            if _is_number(v) and not math.isnan(float(v))]


def as_tags(values: Mapping[str, Any]) -> list[RunTag]:
    """MLflow tags for `log_batch`: every value that is set, as text."""
    return [RunTag(k, str(v)) for k, v in values.items() if v is not None]


def _is_number(value: Any) -> bool:
    # numbers.Real also admits numpy scalars (pandas hands those out); bools are flags, not metrics.
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
