"""The scheduled retraining flow: validate -> train -> refine -> evaluate -> register/promote.

Every task calls one function of `xbn.stages`; no stage logic lives here. Transient failures (a service that
blinked, a killed worker) are retried, and a retried `train` resumes from its last checkpoint; bad data and bad
config are not retried, since a retry cannot fix them. A retried `train` resumes only a checkpoint that this flow
run wrote (`models/last.pt` records it): one left by another run (`make run`, an earlier flow run, other params)
is trained over from scratch.

    python -m pipelines.retrain                 # one run now (ephemeral Prefect server unless PREFECT_API_URL)
    python -m pipelines.retrain --serve         # serve the weekly schedule from this process
    prefect deploy --all                        # or deploy prefect.yaml to a `process` work pool
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run, task_run

from xbn.config import ConfigError, Params, load_params
from xbn.data import DatasetError
from xbn.training.trainer import NonFiniteLossError

DEFAULT_CRON = "0 3 * * 1"  # Mondays 03:00


def _transient(task, task_run_, state) -> bool:
    """Retry unless the failure is the data's or the config's fault."""
    try:
        state.result()
    except (DatasetError, ConfigError, ValueError, NonFiniteLossError):
        return False
    except Exception:  # noqa: BLE001 - anything else may be transient (I/O, a service, a killed worker)
        return True
    return False


TASK_OPTIONS = dict(retries=2, retry_delay_seconds=10, retry_condition_fn=_transient, cache_policy=NO_CACHE)


@task(**TASK_OPTIONS)
def prepare_data(params: Params) -> dict:
    from xbn.stages.prepare import prepare

    return prepare(params)


@task(**TASK_OPTIONS)
def validate_data(params: Params) -> dict:
    from xbn.stages.validate import validate

    return validate(params)


@task(**TASK_OPTIONS)
def train_model(params: Params) -> dict:
    from xbn.stages.train import train

    run_id = flow_run.id  # None when the task is called outside a flow run
    # A retry (run_count > 1) continues from models/last.pt instead of starting over, if this flow run wrote it.
    resume = (task_run.run_count or 1) > 1 and _own_checkpoint(params, run_id)
    return train(params, resume=resume, progress=False, flow_run_id=run_id)


def _own_checkpoint(params: Params, run_id: str | None) -> bool:
    """Whether `models/last.pt` is this flow run's (then the retry resumes it; the trainer still checks the
    params). Anything else is another training's: resuming it would report its result as this run's."""
    from xbn.training.trainer import checkpoint_identity

    logger, attempt = get_run_logger(), task_run.run_count
    path = Path(params.train.checkpoint_dir) / "last.pt"
    found = checkpoint_identity(path)
    if found is None:
        logger.info("retry %d: no checkpoint at %s yet: training from scratch", attempt, path)
        return False
    if run_id is None or found["flow_run_id"] != str(run_id):
        owner = f"flow run {found['flow_run_id']}" if found["flow_run_id"] else "a run outside any flow run"
        logger.warning("retry %d: %s (epoch %d) belongs to %s, not to this flow run %s: training from scratch",
                       attempt, path, found["epoch"], owner, run_id)
        return False
    logger.info("retry %d: resuming from %s at epoch %d (this flow run's checkpoint)", attempt, path,
                found["epoch"])
    return True


@task(**TASK_OPTIONS)
def refine_embeddings(params: Params) -> dict:
    from xbn.stages.refine import refine

    return refine(params)  # a 'disabled' marker only, unless refine.enabled


@task(**TASK_OPTIONS)
def evaluate_model(params: Params) -> dict:
    from xbn.stages.evaluate import evaluate

    return evaluate(params)


@task(**TASK_OPTIONS)
def register_model(params: Params) -> dict:
    from xbn.stages.register import register

    return register(params)


def summary_markdown(params: Params, metrics: dict, decision: dict) -> str:
    champion = decision.get("champion_metrics") or {}
    rows = ["| metric | this run | champion |", "|---|---|---|"]
    for key in [f"recall@{k}" for k in params.eval.k] + ["map@r", "r_precision", "nmi"]:
        if key in metrics:
            theirs = champion.get(key)
            rows.append(f"| {key} | {metrics[key]:.4f} | {'' if theirs is None else f'{theirs:.4f}'} |")
    lines = [
        f"# Retrain: `{params.registry.model_name}` version {decision.get('version')}",
        f"**Decision:** {decision.get('decision')} — {decision.get('reason')}",
        "",
        *rows,
        "",
        f"Memory `{params.memory.method}`, dataset `{params.data.dataset}`.",
    ]
    if decision.get("run_url"):
        lines.append(f"[MLflow run]({decision['run_url']})")
    return "\n".join(lines)


@flow(name="xbn-retrain", log_prints=True)
def retrain(params_path: str = "params.yaml", overrides: list[str] | None = None) -> dict:
    params = load_params(params_path, overrides)
    if params.tracking.enabled:
        # One MLflow run per flow run: every stage task joins it through the environment.
        from xbn.tracking import PARENT_RUN_ENV, pipeline_run, tracking_uri
        from xbn.tracking.services import check_reachable

        check_reachable(tracking_uri(params))  # a store that is down fails the flow now, not after training

        with pipeline_run(params, "retrain", new=True) as run:
            os.environ[PARENT_RUN_ENV] = run.run_id
        try:
            return _run_stages(params)
        finally:
            os.environ.pop(PARENT_RUN_ENV, None)
    return _run_stages(params)


def _run_stages(params: Params) -> dict:
    prepare_data(params)
    validate_data(params)
    train_model(params)
    refine_embeddings(params)
    metrics = evaluate_model(params)
    decision = register_model(params)
    create_markdown_artifact(markdown=summary_markdown(params, metrics, decision), key="xbn-retrain-summary",
                             description="metrics vs champion and the promotion decision")
    return {"metrics": metrics, "decision": decision}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--serve", action="store_true", help="serve the schedule instead of running once")
    parser.add_argument("--cron", default=DEFAULT_CRON)
    args = parser.parse_args(argv)
    if args.serve:
        # limit=1: at most one retraining at a time from this process.
        retrain.serve(name="xbn-weekly-retrain", cron=args.cron, limit=1,
                      parameters={"params_path": args.params, "overrides": args.overrides})
    else:
        retrain(args.params, args.overrides)


if __name__ == "__main__":
    main()
