"""The scheduled retraining flow: prepare -> snapshot the data (DVC) -> plan -> validate -> [tune] -> train ->
refine -> evaluate -> register/promote -> index, and notify.

Every task calls one function of `xbn.stages`; no stage logic lives here. The plan (`xbn.stages.schedule`)
compares the data snapshot and the requested params with the champion's: nothing changed, nothing is retrained
(the run completes in seconds, saying since which version; `--force` trains anyway); otherwise the champion is
fine-tuned (`train.init: champion`, with a drift report of the data against the champion's), or, without a
champion, with a model it does not fit, or on significant drift when `drift.retrain_from_pretrained`, training
starts from pretrained weights. A failure after the retries, a promotion and a challenger held for review are
sent to `notify.urls` (Apprise). With `catalogue.source` set (and `catalogue.on_promotion`), a promoted
champion is indexed over the whole catalogue by the catalogue flow (xbn/flows/catalogue.py, on a Dask cluster)
instead of over the dataset's gallery. Transient failures (a service that
blinked, a killed worker) are retried, and a retried `train` resumes from its last checkpoint; bad data and bad
config are not retried, since a retry cannot fix them. A retried `train` resumes only a checkpoint that this flow
run wrote (`models/last.pt` records it): one left by another run (`make run`, an earlier flow run, other params)
is trained over from scratch.

With tuning on (`--tune`, the flow parameter `tune`, or `tune.enabled` in the params, which the deployment sets),
the Optuna study of `xbn tune` runs after validation and the model is trained with its best trial's values. The
study is persistent and named by the params its trials depend on, so next week's run continues it (or reuses
it, once it has `tune.trials`) instead of starting over. The tuned values go to the run (MLflow params, and tags
`tuned_study`, `tuned_values`) and to the summary; params.yaml is not changed (`xbn tune --apply` does that).

    xbn retrain                                 # one run now, from any folder (same as python -m xbn.flows.retrain)
    python -m xbn.flows.retrain --force         # train even if nothing changed since the champion
    python -m xbn.flows.retrain --tune          # validate, tune, train with the best values, evaluate, register
    python -m xbn.flows.retrain --serve         # serve the weekly schedule from this process
    prefect deploy --all                        # or deploy prefect.yaml to a `process` work pool
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run, task_run

from xbn.config import ConfigError, Params, flatten, load_params
from xbn.config.record import write_record
from xbn.data.snapshot import DataSnapshot, check_versioning
from xbn.flows.catalogue import catalogue as catalogue_flow
from xbn.flows.tasks import TASK_OPTIONS
from xbn.stages.data import snapshot_data as snapshot
from xbn.stages.index import champion_index_problem, index, index_version
from xbn.stages.loop import RepairSteps, repair
from xbn.stages.names import check_names, load_checked
from xbn.stages.notify import notify
from xbn.stages.prepare import prepare
from xbn.stages.summary import summary_markdown
from xbn.utils.allocator import fix_malloc_thresholds
from xbn.utils.faults import fault_point
from xbn.utils.locks import RunBusy
from xbn.utils.secrets import masks_exceptions

DEFAULT_CRON = "0 3 * * 1"  # Mondays 03:00


def _recorded(stage: str, params: Params, run):
    """Run a stage with its params recorded as `xbn run` records them (reports/params.resolved.yaml: running,
    then done or failed), so that `xbn summary` and the summary artifact read this run's files only."""
    write_record(params, stage, "running", None, None)
    try:
        result = run(params)
    except BaseException as exc:
        write_record(params, stage, "failed", None, None, reason=f"{type(exc).__name__}: {exc}")
        raise
    write_record(params, stage, "done", None, None)
    return result



@task(**TASK_OPTIONS)
@masks_exceptions
def prepare_data(params: Params) -> dict:
    return _recorded("prepare", params, prepare)


@task(**TASK_OPTIONS)
@masks_exceptions
def snapshot_data(params: Params) -> dict:
    return snapshot(params)  # DVC add + push: the fingerprint the plan compares, restorable later


@task(**TASK_OPTIONS)
@masks_exceptions
def interrupted_registrations(params: Params) -> list[int]:
    from xbn.stages.register import interrupted_versions

    return interrupted_versions(params)  # what a killed run left half registered, finished before the plan


@task(**TASK_OPTIONS)
@masks_exceptions
def complete_registration(params: Params, version: int) -> dict:
    from xbn.stages.register import complete_version

    return complete_version(params, version)


@task(**TASK_OPTIONS)
@masks_exceptions
def abandon_registration(params: Params, version: int, reason: str) -> dict:
    from xbn.stages.register import abandon

    return abandon(params, version, reason, by_gate=True)  # it could not be completed: it never stops a week


@task(**TASK_OPTIONS)
@masks_exceptions
def registration_of(params: Params, version: int) -> dict:
    from xbn.stages.register import registration

    return registration(params, version)  # as it stands after the index stage completed a promotion


@task(**TASK_OPTIONS)
@masks_exceptions
def check_champion_index(params: Params) -> dict | None:
    return champion_index_problem(params)


@task(**TASK_OPTIONS)
@masks_exceptions
def index_champion(params: Params, version: int) -> dict:
    return index_version(params, version)  # from its own registered checkpoint: nothing is retrained


@task(**TASK_OPTIONS)
@masks_exceptions
def plan_retraining(params: Params, data: dict, force: bool) -> dict:
    from xbn.stages.schedule import plan

    return plan(params, DataSnapshot(**data), force=force).as_dict()


@task(**TASK_OPTIONS)
@masks_exceptions
def validate_data(params: Params) -> dict:
    from xbn.stages.validate import validate

    return _recorded("validate", params, validate)


@task(**TASK_OPTIONS)
@masks_exceptions
def train_model(params: Params) -> dict:
    from xbn.stages.train import train

    run_id = flow_run.id  # None when the task is called outside a flow run
    # A retry (run_count > 1) continues from models/last.pt instead of starting over, if this flow run wrote it.
    resume = (task_run.run_count or 1) > 1 and _own_checkpoint(params, run_id)
    return _recorded("train", params, lambda p: train(p, resume=resume, progress=False, flow_run_id=run_id))


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
@masks_exceptions
def refine_embeddings(params: Params) -> dict:
    from xbn.stages.refine import refine

    return _recorded("refine", params, refine)  # a 'disabled' marker only, unless refine.enabled


@task(**TASK_OPTIONS)
@masks_exceptions
def evaluate_model(params: Params) -> dict:
    from xbn.stages.evaluate import evaluate

    return _recorded("evaluate", params, evaluate)


@task(**TASK_OPTIONS)
@masks_exceptions
def register_model(params: Params, tags: dict) -> dict:
    from xbn.stages.register import register

    return _recorded("register", params, lambda p: register(p, tags=tags))


@task(**TASK_OPTIONS)
@masks_exceptions
def index_catalogue(params: Params) -> dict:
    return _recorded("index", params, index)  # attached to the version just registered: it moves with it


@task(**TASK_OPTIONS)
@masks_exceptions
def tune_study(params: Params) -> dict:
    from xbn.stages.tune import tune

    return tune(params)  # a retry continues the same persistent study


# Hook arguments by these names: Prefect's runner (the worker) calls on_crashed with keywords (flow=, flow_run=,
# state=) after the flow's process died, and a hook with other names failed with a TypeError, telling nobody.
def _notify_failure(flow, flow_run, state) -> None:
    """The flow's on_failure hook: runs once the flow has failed, after every task's retries. A run refused
    because another holds the model's run lock changed nothing: it says so, not that the pipeline failed."""
    if _refused(state):
        _notify_end(flow_run, state, "REFUSED", "did not start: another run on the same model holds its run lock; "
                    "nothing was changed")
    else:
        _notify_end(flow_run, state, "FAILED", "failed after its retries")


def _refused(state) -> bool:
    try:
        return isinstance(state.result(raise_on_failure=False), RunBusy)
    except Exception:  # noqa: BLE001 - a result that cannot be read back: only the message can tell
        return "RunBusy" in (state.message or "")


def _notify_crash(flow, flow_run, state) -> None:
    """The flow's on_crashed hook: the process was killed (then the worker runs this hook), or Prefect lost it
    (a server restart that dropped its concurrency lease). A crashed run is not retried, so a person must hear of
    it as of a failure."""
    _notify_end(flow_run, state, "CRASHED", "crashed (killed, or lost by the Prefect server); it is not retried")


def _notify_end(run, state, word: str, what: str) -> None:
    parameters = run.parameters or {}
    try:
        params = load_params(parameters.get("params_path", "params.yaml"), parameters.get("overrides") or [])
    except Exception:  # noqa: BLE001 - a bad override may be the very failure: still say so, with the defaults
        try:
            params = load_params(parameters.get("params_path", "params.yaml"))
        except Exception:  # noqa: BLE001
            params = Params()
    notify(params.notify, f"xbn retrain {word}: {run.name}",
           f"Flow run {run.name} {what}: {state.message or state.name}\n{_link(run.id)}")


def _link(run_id) -> str:
    from prefect.settings import PREFECT_UI_URL

    ui = PREFECT_UI_URL.value()
    return f"{ui.rstrip('/')}/runs/flow-run/{run_id}" if ui else f"flow run id {run_id}"


@flow(name="xbn-retrain", log_prints=True, on_failure=[_notify_failure], on_crashed=[_notify_crash])
@masks_exceptions
def retrain(params_path: str = "params.yaml", overrides: list[str] | None = None,
            tune: bool | None = None, force: bool = False) -> dict:
    """`tune`: run the study first (None: as `tune.enabled` says); `force`: retrain even if nothing changed."""
    fix_malloc_thresholds()  # as `xbn` does: a Prefect worker runs this flow in a process of its own
    fault_point("retrain.start")
    overrides = list(overrides or [])
    # The schema now; the names it gives (loss, miner, backbone: torch, pytorch-metric-learning and timm, seconds
    # of imports in this fresh process) once the plan decides to train. A week where nothing changed needs none.
    params = load_params(params_path, overrides)
    if params.tracking.enabled:
        from xbn.tracking import tracking_uri
        from xbn.tracking.services import check_reachable

        check_reachable(tracking_uri(params))  # a store that is down fails the flow now, not after training

    check_versioning(params)  # no DVC project or remote for the data's snapshot: fail now, with the way out
    if not params.tracking.enabled:
        return _retrain(params, params_path, overrides, tune, force)
    from xbn.tracking.locks import pipeline_lock

    # One run per registered model at a time, whatever started it (a deployment run, `xbn retrain`, `xbn run`,
    # `xbn register`; across machines with tracking.lock_uri): a second one refuses to start (RunBusy).
    with pipeline_lock(params, "xbn retrain"):
        fault_point("retrain.locked")  # the run lock held (tests/pipeline/test_two_runs.py waits here)
        return _retrain(params, params_path, overrides, tune, force)


def _retrain(params: Params, params_path: str, overrides: list[str], tune: bool | None, force: bool) -> dict:
    logger = get_run_logger()
    prepare_data(params)
    data = snapshot_data(params)
    if params.tracking.enabled:
        # Before "nothing changed": what a killed or failed run left behind is repaired first, without training
        # (xbn.stages.loop, shared with `xbn run`; here each step is a task, retried).
        steps = RepairSteps(interrupted=interrupted_registrations, complete=complete_registration,
                            registration=registration_of, check_index=check_champion_index,
                            attach_index=lambda p, version: _attach_index(p, params_path, overrides, version),
                            abandon=abandon_registration)
        for repaired in repair(params, steps):
            logger.warning("registry: %s", repaired.line)
            notify(params.notify, repaired.title, f"Flow run {flow_run.name}: {repaired.line}")
        decision = plan_retraining(params, data, force)
    else:  # no registry, no champion to compare with or start from
        decision = {"retrain": True, "init": "pretrained", "reason": "tracking disabled: training from "
                    "pretrained weights", "champion": None, "request_hash": None, "drift": None}
    logger.info("plan: %s", decision["reason"])
    if not decision["retrain"]:
        markdown = f"# xbn retrain: `{params.registry.model_name}`\n\n{decision['reason']}"
        create_markdown_artifact(markdown=markdown, key="xbn-retrain-summary",
                                 description="what this retraining did: nothing had changed")
        logger.info("registry: unchanged, champion v%s (%s)", decision["champion"], decision["reason"])
        return {"retrained": False, "plan": decision}
    check_names(params)  # before any data is validated or trained on (a bad name is a ConfigError: not retried)
    validate_data(params)
    tuned: dict = {}
    if params.tune.enabled if tune is None else tune:
        from xbn.tuning import as_overrides, tuned_values

        # The study's trials train from pretrained weights, as requested (a fine-tuning is not what it scores).
        study = tune_study(params if params.train.init == "pretrained"
                           else load_checked(params_path, [*overrides, "train.init=pretrained"]))
        tuned = {"study": study["study"], "values": tuned_values(study)}
        overrides += as_overrides(tuned["values"])
        logger.info("study %s: training with %s", tuned["study"], tuned["values"])
    # The user's own train.init (a path, or champion) wins; else the plan's choice.
    init = params.train.init if params.train.init != "pretrained" else decision["init"]
    overrides = [*overrides, f"train.init={init}"]
    params = load_checked(params_path, overrides)
    if not params.tracking.enabled:
        return _train_to_registry(params, tuned, decision, (params_path, overrides))
    # One MLflow run per flow run, opened with the params the model trains with: every stage task joins it
    # through the environment.
    import json

    from xbn.tracking import PARENT_RUN_ENV, pipeline_run
    from xbn.tracking.runs import log_files

    tags = {"tuned_study": tuned["study"], "tuned_values": json.dumps(tuned["values"])} if tuned else {}
    tags |= {"xbn.plan": decision["reason"][:5000], "xbn.init": init}
    with pipeline_run(params, "retrain", tags=tags, new=True) as run:
        os.environ[PARENT_RUN_ENV] = run.run_id
        if decision["drift"]:
            report = Path(params.drift.report)
            log_files(run, [report, report.with_suffix(".md"), report.with_suffix(".png")], "drift")
    try:
        return _train_to_registry(params, tuned, decision, (params_path, overrides))
    finally:
        os.environ.pop(PARENT_RUN_ENV, None)


def _attach_index(params: Params, params_path: str, overrides: list[str], version: int) -> None:
    """Index registry version `version` from its own checkpoint (nothing is retrained), over the whole catalogue
    when the champion serves one (the catalogue flow), else over the dataset's gallery."""
    if params.catalogue.source and params.catalogue.on_promotion:
        catalogue_flow(params_path, overrides, version=version)
    else:
        index_champion(params, version)


def _train_to_registry(params: Params, tuned: dict, decision: dict, loaded_from: tuple[str, list[str]]) -> dict:
    """`loaded_from`: the params file and overrides `params` came from (the catalogue flow loads them again)."""
    logger = get_run_logger()
    train_model(params)
    fault_point("retrain.after_train")
    refine_embeddings(params)
    metrics = evaluate_model(params)
    registered = register_model(params, {"request_hash": decision["request_hash"]} if decision["request_hash"]
                                else {}) if params.tracking.enabled else None
    promoted = bool(registered and registered["decision"] == "promoted")
    fault_point("retrain.after_register")  # promoted by the gate, not champion until its index is attached
    full_catalogue = None
    if promoted and params.catalogue.source and params.catalogue.on_promotion:
        # The new champion serves the whole catalogue, not the dataset's gallery: until the catalogue flow has
        # attached its index, serving keeps the previous champion (a version without an index is not loaded).
        assert registered is not None  # promoted: registered
        full_catalogue = catalogue_flow(*loaded_from, version=registered["version"])
        catalogue = {"version": registered["version"], **(full_catalogue["index"] or {})}  # None: up to date
    else:
        catalogue = index_catalogue(params)
    if promoted:  # promote last: the index stage made it champion once its index was attached
        assert registered is not None
        registered = {**registration_of(params, registered["version"]),
                      "already_registered": registered.get("already_registered")}
    markdown = summary_markdown(params) + f"\n\n**Plan:** {decision['reason']}"
    if decision["drift"]:
        markdown += f"\n\n**Drift:** {decision['drift']['line']} (`{params.drift.report}`)"
    if tuned:
        markdown += f"\n\nTuned by study `{tuned['study']}`: " + ", ".join(
            f"`{k}` = {v:.4g}" if isinstance(v, float) else f"`{k}` = {v}" for k, v in tuned["values"].items())
    create_markdown_artifact(markdown=markdown, key="xbn-retrain-summary",
                             description="what this retraining did: data, memory, metrics, registry decision")
    if registered and not registered.get("already_registered"):
        _notify_decision(params, registered, metrics, decision, _gate_overrides(params, loaded_from[0]))
    if registered:  # the last line: what the registry decided
        logger.info("registry: %s v%s %s: %s", registered["model_name"], registered["version"],
                    registered["decision"], registered["reason"])
    return {"retrained": True, "plan": decision, "metrics": metrics, "decision": registered, "index": catalogue,
            "catalogue": full_catalogue, "tuned": tuned}


def _gate_overrides(params: Params, params_path: str) -> list[str]:
    """The registry.* settings this run's overrides changed from the params file: anyone who can start the
    deployment can pass registry.confidence=0.01 or an empty guarded_metrics, and a reviewer must hear of it."""
    try:
        base = flatten(load_params(params_path).registry, "registry.")
    except (ConfigError, OSError):
        return ["registry.*: the params file could not be read back to compare"]
    now = flatten(params.registry, "registry.")
    return [f"{k}: {base.get(k)!r} -> {v!r}" for k, v in now.items() if base.get(k) != v]


def _notify_decision(params: Params, registered: dict, metrics: dict, decision: dict,
                     gate_overrides: list[str] | None = None) -> None:
    """A promotion, or a challenger held for a person's review (the gate did not promote it)."""
    version, verdict = registered["version"], registered["decision"]
    if verdict == "promoted" and registered.get("registration") == "awaiting_index":
        title = f"xbn: v{version} promoted by the gate, not champion yet: its index is not attached"
    elif verdict == "promoted":
        title = f"xbn: v{version} promoted to champion"
    else:
        title = f"xbn: v{version} held for review ({verdict})"
    r1 = metrics.get("recall@1") if isinstance(metrics, dict) else None
    body = "\n".join([
        f"Flow run {flow_run.name}: {_link(flow_run.id)}",
        f"{registered['model_name']} v{version}: {verdict}: {registered['reason']}",
        f"test R@1 {r1:.4f}" if isinstance(r1, float) else "test R@1: not evaluated",
        f"plan: {decision['reason']}",
        *([f"drift: {decision['drift']['line']}"] if decision["drift"] else []),
        *([f"the gate was changed by this run's overrides: {'; '.join(gate_overrides)}"] if gate_overrides
          else []),
    ])
    notify(params.notify, title, body)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--serve", action="store_true", help="serve the schedule instead of running once")
    parser.add_argument("--cron", default=DEFAULT_CRON)
    parser.add_argument("--tune", action="store_true", default=None,
                        help="run the Optuna study first and train with its best values (default: tune.enabled)")
    parser.add_argument("--force", action="store_true", help="retrain even if nothing changed since the champion")
    args = parser.parse_args(argv)
    if args.serve:
        # limit=1: at most one retraining at a time from this process.
        retrain.serve(name="xbn-weekly-retrain", cron=args.cron, limit=1,
                      parameters={"params_path": args.params, "overrides": args.overrides, "tune": args.tune})
    else:
        retrain(args.params, args.overrides, args.tune, args.force)


if __name__ == "__main__":
    main()
