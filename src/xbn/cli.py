"""The `xbn` command: one subcommand per pipeline stage, each reading params.yaml (validated first)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import traceback
from typing import Any, NamedTuple

from xbn import __version__
from xbn.config import DATASETS, ConfigError, Params, load_params
from xbn.config.record import resolve_params, write_record
from xbn.data import DatasetError
from xbn.data.snapshot import check_versioning
from xbn.flows import prefect_api
from xbn.stages.catalogue import check_source, target_version
from xbn.stages.data import restore_data, snapshot_data
from xbn.stages.index import index, index_version
from xbn.stages.init import init
from xbn.stages.loop import ORDER as LOOP_ORDER
from xbn.stages.loop import RepairSteps, repair
from xbn.stages.names import check_names
from xbn.stages.notify import notify
from xbn.stages.prepare import prepare
from xbn.stages.summary import summary_rows, summary_text
from xbn.utils.allocator import fix_malloc_thresholds
from xbn.utils.errors import (
    EXIT_CONFIG,
    EXIT_DATA,
    EXIT_FAILURE,
    EXIT_SERVICE,
    EnvironmentSettingError,
    IntegrityError,
    NonFiniteLossError,
    RegistryError,
    ServiceUnavailableError,
    TrainingStalledError,
)
from xbn.utils.locks import LockLost, RunBusy
from xbn.utils.logs import configure_logging
from xbn.utils.progress import set_quiet
from xbn.utils.secrets import mask_secrets

# The commands that build a loss, a backbone or use the device: their params also have those names resolved
# when loaded (`check_names` imports torch, pytorch-metric-learning and timm: seconds in a fresh process,
# which the other commands need not pay).
RESOLVES_NAMES = ("train", "run", "tune", "refine", "evaluate", "register", "retrain")
log = logging.getLogger("xbn.cli")


def _stage_generate(params: Params, args) -> dict:
    from xbn.data.glyphs import generate_glyphs

    g = params.data.glyphs
    root = generate_glyphs(params.data.root, classes=g.classes, images_per_class=g.images_per_class,
                           image_size=g.image_size, seed=g.seed)
    log.info("%d glyph classes x %d images, %d px -> %s", g.classes, g.images_per_class, g.image_size, root)
    return {"root": str(root), **g.model_dump()}


def _stage_validate(params: Params, args) -> dict:
    from xbn.stages.validate import validate

    return validate(params)


def _stage_register(params: Params, args) -> dict:
    from xbn.stages.register import register

    report = register(params)
    log.info("%s v%s %s: %s", report["model_name"], report["version"], report["decision"], report["reason"])
    if report["registration"] == "awaiting_index":
        serving = f"v{report['champion_version']} serves" if report["champion_version"] else "no version serves"
        log.info("%s v%s becomes champion once its index is attached (`xbn index`); until then %s",
                 report["model_name"], report["version"], serving)
    return report


def _registry(params: Params, args):
    from xbn.stages import register as registry

    if args.action == "review":
        return registry.review(params)
    if args.action == "promote":
        return registry.promote(params, args.model_version, args.reason, user=args.user)
    if args.action == "abandon":
        return registry.abandon(params, args.model_version, args.reason, user=args.user)
    return registry.rollback(params, args.reason, user=args.user)


def _retrain(params: Params, args) -> Report | None:
    """The Prefect flow (xbn/flows/retrain.py), from any folder: once now, or serving the weekly schedule."""
    check_versioning(params)  # before Prefect starts its server: a missing DVC project fails in a second
    from xbn.flows.retrain import DEFAULT_CRON, retrain

    tune = True if args.tune else None
    if args.serve:
        retrain.serve(name="xbn-weekly-retrain", cron=args.cron or DEFAULT_CRON, limit=1,
                      parameters={"params_path": args.params, "overrides": args.overrides, "tune": tune})
        return None
    with prefect_api():
        result = retrain(args.params, args.overrides, tune, args.force)
    lines = [f"plan: {result['plan']['reason']}"]
    if decision := result.get("decision"):
        lines.append(f"registry: {decision['model_name']} v{decision['version']} {decision['decision']}: "
                     f"{decision['reason']}")
    return Report("\n".join(lines), result)


def _catalogue(params: Params, args) -> dict:
    """The Prefect flow (xbn/flows/catalogue.py): the catalogue embedded on a Dask cluster, indexed, attached."""
    check_source(params)  # no catalogue, no registry or no champion: fail before Prefect starts
    target_version(params, args.model_version)
    from xbn.flows.catalogue import catalogue

    with prefect_api():
        report = catalogue(args.params, args.overrides, args.model_version, args.address)
    embedded = report.pop("embedded")
    report["shards_embedded"] = len(embedded)
    report["images_embedded"] = sum(r.get("written", 0) for r in embedded)
    return report


def _data(params: Params, args) -> dict:
    if args.action == "snapshot":
        return snapshot_data(params)
    return restore_data(params, args.to, version=args.model_version, run_id=args.run)


def _stage_prepare(params: Params, args) -> dict:
    return prepare(params)


def _stage_train(params: Params, args) -> dict:
    nproc, nodes = getattr(args, "nproc", 1), getattr(args, "nodes", None)  # `xbn run` trains in one process
    if nproc > 1 or nodes is not None:
        from xbn.utils.distributed import launch

        # torchrun (torch.distributed.run) starts this same command N times on this machine (and on each of
        # --nnodes machines), each with its RANK and WORLD_SIZE; the global rank 0 prints the summary, so this
        # process only passes on the exit status.
        forwarded = ["train", "--params", args.params, *(f"--set={o}" for o in args.overrides),
                     *(["--resume"] if args.resume else []), *(["--quiet"] if args.quiet else []),
                     *(["--verbose"] if args.verbose else [])]
        raise SystemExit(launch(nproc, "xbn.cli", forwarded, nodes))
    from xbn.stages.train import train

    return train(params, resume=args.resume, progress=not args.quiet, params_file=args.params)


def _train_nodes(args):
    """The `Nodes` of `xbn train --nnodes N --node-rank R --rdzv-endpoint HOST:PORT`, or None on one machine;
    a ConfigError naming the flag when they do not fit together."""
    from xbn.utils.distributed import Nodes

    several = args.nnodes > 1
    if not several:
        given = [flag for flag, value in (("--node-rank", args.node_rank), ("--rdzv-endpoint", args.rdzv_endpoint),
                                          ("--rdzv-id", args.rdzv_id)) if value is not None]
        if given:  # a forgotten --nnodes would otherwise train alone on this machine
            raise ConfigError(f"{' and '.join(given)} join a run on several machines: give --nnodes N (N > 1) "
                              "too, or drop them to train on this machine only")
        return None
    if args.rdzv_endpoint is None:
        raise ConfigError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT: the address of node 0 "
                          "(--node-rank 0), where the others meet it")
    if args.node_rank is None:
        raise ConfigError(f"--nnodes {args.nnodes} needs --node-rank R (0 to {args.nnodes - 1}): this machine's "
                          "index, 0 on the machine at --rdzv-endpoint")
    if args.node_rank >= args.nnodes:
        raise ConfigError(f"--node-rank {args.node_rank} is out of range for --nnodes {args.nnodes} "
                          f"(0 to {args.nnodes - 1})")
    return Nodes(args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id or "xbn-train")


def _stage_refine(params: Params, args) -> dict:
    from xbn.stages.refine import refine

    return refine(params)


def _stage_evaluate(params: Params, args) -> dict:
    from xbn.stages.evaluate import evaluate

    return evaluate(params)


def _stage_tune(params: Params, args) -> dict:
    from xbn.stages.tune import tune

    if args.apply and args.worker:
        raise ConfigError("--apply merges the study's result: run it on the coordinator, not a --worker")
    return tune(params, workers=args.workers, worker=args.worker,
                apply_to=args.params if args.apply else None)


def _stage_index(params: Params, args) -> dict:
    if getattr(args, "model_version", None) is not None:  # `xbn run`'s chain has no such option
        return index_version(params, args.model_version)
    return index(params, append=args.append, shards=args.shards)


def _search(params: Params, args) -> Report:
    from xbn.serving.search import format_table
    from xbn.stages.serve import search

    results, loaded = search(params, args.images, args.k, version=args.model_version, local=args.local)
    about = f"{loaded.name} v{loaded.version}{f' ({loaded.alias})' if loaded.alias else ''}"
    report = Report(f"{about}, index of {loaded.index.count}\n\n" + format_table(results), results)
    failed = [r["query"] for r in results if "error" in r]
    if failed:  # every image that could be read has answered: print them, then fail naming the others
        _print_result(report, args)
        raise DatasetError(f"{len(failed)} of {len(results)} image(s) could not be read: {', '.join(failed)}")
    return report


def _serve(params: Params, args) -> None:
    from xbn.stages.serve import serve

    serve(params, args.host, args.port, version=args.model_version, local=args.local)


def _embed(params: Params, args) -> dict:
    from xbn.stages.serve import embed

    return embed(params, args.input, args.output, version=args.model_version, local=args.local,
                 progress=not args.quiet)


def _export(params: Params, args) -> dict:
    from xbn.stages.export import export

    return export(params, args.format, args.output)


# `xbn run`'s chain, dvc.yaml's order (generate is part of prepare for the glyph set).
_STAGE_FNS = {"prepare": _stage_prepare, "validate": _stage_validate, "train": _stage_train,
              "refine": _stage_refine, "evaluate": _stage_evaluate, "register": _stage_register,
              "index": _stage_index}
CHAIN = tuple((name, _STAGE_FNS[name]) for name in LOOP_ORDER)  # the loop's order, shared with the retrain flow


def _recorded(stage: str, fn, params: Params, args):
    """Run one stage, its params recorded for the run's later stages (reports/params.resolved.yaml) before it
    starts and marked done or failed after; only the main process of a distributed run writes."""
    # Not the launcher of a node other than 0 either: on a shared folder it would write the same record.
    main = os.environ.get("RANK") in (None, "0") and getattr(args, "node_rank", None) in (None, 0)
    if main:
        write_record(params, stage, "running", args.params, args.overrides)
    try:
        result = fn(params, args)
    except BaseException as exc:
        if main:
            write_record(params, stage, "failed", args.params, args.overrides,
                         reason=f"{type(exc).__name__}: {exc}")
        raise
    if main:
        write_record(params, stage, "done", args.params, args.overrides)
    return result


def _stage_run(params: Params, args) -> Report:
    """The stages `dvc repro` runs, in its order, up to `--until` (register only with tracking on), then the
    summary. A validation failure (a `DatasetError`) stops it with exit 3, before training."""
    args.resume, args.append, args.shards = False, False, None
    for name, fn in CHAIN:
        if name == "register" and not params.tracking.enabled:
            log.info("register: skipped (tracking.enabled is false)")
        else:
            _recorded(name, fn, params, args)
        if name == args.until:
            break
        if name == "prepare" and params.tracking.enabled:
            _repair(params, args)  # as the retrain flow does, before "nothing changed"
        if name == "prepare" and not args.force:
            from xbn.stages.schedule import unchanged_since_champion

            if reason := unchanged_since_champion(params):  # the retrain flow's rule: same data and params
                return Report(f"xbn run: {reason} (--force trains anyway)", {"skipped": reason})
    return _summary(params, args)


def _repair(params: Params, args) -> None:
    """What a killed run left behind (an unfinished registration, a champion without its index), repaired
    without training before the plan (xbn.stages.loop), each said on stderr and notified. A champion that serves
    the whole catalogue gets its index back from the catalogue flow, as the retrain flow's repair does, not from
    the dataset's gallery (which would serve a fraction of the catalogue, and no check would notice)."""
    steps = RepairSteps()
    if params.catalogue.source and params.catalogue.on_promotion:
        def attach_catalogue(_: Params, version: int) -> dict:
            from xbn.flows.catalogue import catalogue

            with prefect_api():
                return catalogue(args.params, args.overrides, version)

        steps = RepairSteps(attach_index=attach_catalogue)
    for repaired in repair(params, steps):
        print(f"xbn run: {repaired.line}", file=sys.stderr)
        notify(params.notify, repaired.title, f"xbn run: {repaired.line}")


# The commands that change the registry as a pipeline run: one at a time per registered model, whatever started
# them (the retrain flow takes the same lock; `xbn run` registering re-enters it).
RUN_LOCKED = {"run", "register"}


def _run_lock(params: Params, command: str):
    if command not in RUN_LOCKED or not params.tracking.enabled:
        return contextlib.nullcontext()
    from xbn.tracking.locks import pipeline_lock

    return pipeline_lock(params, f"xbn {command}")


class Report(NamedTuple):
    """A command's result that reads as `text` on a terminal and as `data` with `--json`."""

    text: str
    data: Any


def _print_result(result: Report | dict | str, args) -> None:
    """The one rule of every command: `--json` prints the result as JSON; otherwise it is printed as text (a
    stage's dict: its JSON, also in the file the stage wrote; a text, such as `registry review`'s table, as it
    is) unless `-q`. Only rank 0 of a distributed run."""
    if os.environ.get("RANK") not in (None, "0"):
        return
    if isinstance(result, str):
        result = Report(result, result)
    text, data = result if isinstance(result, Report) else (None, result)
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    elif not args.quiet:
        print(text if text is not None else json.dumps(data, indent=2, default=str))


def _summary(params: Params, args) -> Report:
    return Report(summary_text(params), {"summary": [{"what": what, "value": value}
                                                     for what, value in summary_rows(params)]})


class _ModelVersion(argparse.Action):
    """`--model-version V`, the one name for a registry version in every command; the old `--version V` of
    `registry promote` and `data restore` still works, with a deprecation line (`xbn --version` is xbn's)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string == "--version":
            print(f"{parser.prog}: --version V is deprecated: use --model-version V", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _endpoint(text: str) -> str:
    from xbn.utils.distributed import parse_endpoint

    try:
        parse_endpoint(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def _common_options(defaults: bool = True) -> argparse.ArgumentParser:
    """The options every command takes. `defaults=False`: the same for a command's action (`xbn registry review
    --json`), set only when given there, so they never reset what was given before the action."""
    common = argparse.ArgumentParser(add_help=False)

    def default(value):
        return value if defaults else argparse.SUPPRESS

    common.add_argument("--params", default=default("params.yaml"), help="params file (default: params.yaml)")
    common.add_argument("--set", dest="overrides", action="append", default=default([]), metavar="KEY=VALUE",
                        help="override a param, e.g. --set memory.method=xbn (repeatable)")
    common.add_argument("-q", "--quiet", action="store_true", default=default(False),
                        help="no progress bars, and no result on the console unless --json asks for it (a "
                             "stage's result is in the file it wrote; the exit code says how it went)")
    common.add_argument("-v", "--verbose", action="store_true", default=default(False),
                        help="every library's log lines too")
    common.add_argument("--json", action="store_true", default=default(False),
                        help="print the result as JSON, on every command (the stages' results are JSON "
                             "anyway; summary, run, retrain and search print text without it), even with -q")
    return common


EXIT_CODES_HELP = ("exit codes: 0 done; 1 the run failed (a non-finite loss, another run in progress, nothing to "
                   "roll back to); 2 a param, an option or an account is wrong (the message names it); 3 the data "
                   "or a file a stage needs is missing or invalid; 4 a service the run needs cannot be reached")


# `xbn --help` lists the subcommands by what a person is doing (every subcommand in exactly one group).
COMMAND_GROUPS = (
    ("pipeline", ("init", "run", "train", "refine", "evaluate", "register", "tune", "retrain", "summary")),
    ("data", ("generate", "prepare", "validate", "data")),
    ("registry", ("registry",)),
    ("serving", ("index", "catalogue", "search", "serve", "embed", "export")),
)


class _GroupedCommands(argparse.HelpFormatter):
    """argparse lists subcommands in one flat list; this lists them under COMMAND_GROUPS' headings."""

    def _format_action(self, action):
        if not isinstance(action, argparse._SubParsersAction):
            return super()._format_action(action)
        by_name = {sub.dest: sub for sub in action._get_subactions()}
        parts = []
        for group, names in COMMAND_GROUPS:
            parts.append(f"{' ' * self._current_indent}{group}:\n")
            self._indent()
            parts += [self._format_action(by_name[name]) for name in names]
            self._dedent()
        return "".join(parts)


def build_parser() -> argparse.ArgumentParser:
    common, after_action = _common_options(), _common_options(defaults=False)
    parser = argparse.ArgumentParser(prog="xbn", description=__doc__, epilog=EXIT_CODES_HELP,
                                     formatter_class=_GroupedCommands)

    parser.add_argument("--version", action="version", version=f"xbn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")

    init = sub.add_parser("init", help="write a params.yaml for a dataset into the current folder (then: xbn run)")
    init.add_argument("--dataset", required=True, choices=DATASETS, help="the dataset's on-disk format")
    init.add_argument("--root", required=True, help="the dataset's folder (data.root)")
    init.add_argument("--labels-file", default=None, help="csv datasets: the path,label,split file")
    init.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="any other param to write, e.g. --set data.image_size=224 (repeatable)")
    init.add_argument("--force", action="store_true", help="replace an existing params.yaml")
    init.add_argument("-v", "--verbose", action="store_true", help=argparse.SUPPRESS)
    sub.add_parser("generate", parents=[common],
                   help="generate the embedded glyph dataset at data.root").set_defaults(fn=_stage_generate)
    sub.add_parser("prepare", parents=[common], help="read the dataset, write the manifest").set_defaults(
        fn=_stage_prepare)
    sub.add_parser("validate", parents=[common],
                   help="check the manifest and images before training").set_defaults(fn=_stage_validate)
    train = sub.add_parser("train", parents=[common], help="train the embedding model")
    train.add_argument("--resume", action="store_true", help="continue from models/last.pt")
    train.add_argument("--nproc", type=_positive_int, default=1, metavar="N",
                       help="data-parallel processes on this machine, launched with torchrun (one GPU "
                            "each on CUDA); train.batch_size stays the global batch")
    nodes = train.add_argument_group(
        "several machines", "run the same command on each machine, --node-rank 0 on the one at --rdzv-endpoint; "
        "data and train.checkpoint_dir on a shared filesystem (docs/training.md: Training on several machines)")
    nodes.add_argument("--nnodes", type=_positive_int, default=1, metavar="N",
                       help="machines taking part, each running --nproc processes (torchrun's c10d rendezvous)")
    nodes.add_argument("--node-rank", type=_non_negative_int, default=None, metavar="R",
                       help="this machine's index, 0 to N-1; node 0 hosts the rendezvous")
    nodes.add_argument("--rdzv-endpoint", type=_endpoint, default=None, metavar="HOST:PORT",
                       help="node 0's address and a free port there, reachable from every node")
    nodes.add_argument("--rdzv-id", default=None, metavar="ID",
                       help="the job's name at the rendezvous, the same on every node (default: xbn-train)")
    train.set_defaults(fn=_stage_train)
    sub.add_parser("refine", parents=[common],
                   help="train the neighbourhood-context refiner on the frozen embeddings (refine.enabled)"
                   ).set_defaults(fn=_stage_refine)
    sub.add_parser("evaluate", parents=[common], help="retrieval metrics on the test protocol").set_defaults(
        fn=_stage_evaluate)
    sub.add_parser("register", parents=[common],
                   help="register the model as a challenger and apply the promotion gate").set_defaults(
        fn=_stage_register)
    registry = sub.add_parser("registry", parents=[common], help="review and move the registry's aliases")
    actions = registry.add_subparsers(dest="action", required=True)
    actions.add_parser("review", parents=[after_action], help="champion vs challenger, side by side")
    promote = actions.add_parser("promote", parents=[after_action], help="make a version the champion")
    promote.add_argument("--model-version", "--version", dest="model_version", required=True, type=_positive_int,
                         action=_ModelVersion, metavar="V", help="the registry version to make champion")
    promote.add_argument("--reason", required=True)
    rollback = actions.add_parser("rollback", parents=[after_action], help="restore the previous champion")
    rollback.add_argument("--reason", required=True)
    abandon = actions.add_parser("abandon", parents=[after_action], help="give up an unfinished registration "
                                 "that cannot be completed (held, never tried again)")
    abandon.add_argument("--model-version", "--version", dest="model_version", required=True, type=_positive_int,
                         action=_ModelVersion, metavar="V", help="the registry version to abandon")
    abandon.add_argument("--reason", required=True)
    for p in (promote, rollback, abandon):
        p.add_argument("--user", default=None, help="who decides (default: $USER)")
    registry.set_defaults(fn=_registry)
    retrain = sub.add_parser("retrain", parents=[common],
                             help="the scheduled retraining flow (Prefect), once now: snapshot the data, skip if "
                                  "nothing changed, else fine-tune the champion (or train), register, index")
    retrain.add_argument("--tune", action="store_true", help="run the Optuna study first (else tune.enabled)")
    retrain.add_argument("--force", action="store_true", help="retrain even if nothing changed")
    retrain.add_argument("--serve", action="store_true", help="serve the weekly schedule from this process")
    retrain.add_argument("--cron", default=None, help="the schedule for --serve (default: Mondays 03:00)")
    retrain.set_defaults(fn=_retrain)
    catalogue = sub.add_parser("catalogue", parents=[common],
                               help="the Prefect flow: embed catalogue.source with the champion on a Dask cluster "
                                    "(shards, resumable), index it and attach the index to the version")
    catalogue.add_argument("--model-version", type=_positive_int, default=None, metavar="V",
                           help="this registry version instead of the champion")
    catalogue.add_argument("--address", default=None, metavar="tcp://HOST:PORT",
                           help="the Dask scheduler (default: $DASK_SCHEDULER_ADDRESS, catalogue.scheduler_address, "
                                "else a LocalCluster of this machine's cores)")
    catalogue.set_defaults(fn=_catalogue)
    data = sub.add_parser("data", parents=[common], help="the training data's DVC snapshots")
    data_actions = data.add_subparsers(dest="action", required=True)
    data_actions.add_parser("snapshot", parents=[after_action],
                            help="track data.root with DVC and push it (what the retrain flow does)")
    restore = data_actions.add_parser("restore", parents=[after_action],
                                      help="bring back the images a version or a run trained on")
    source = restore.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-version", "--version", dest="model_version", type=_positive_int, default=None,
                        action=_ModelVersion, metavar="V", help="registry version")
    source.add_argument("--run", default=None, metavar="RUN_ID", help="MLflow run id")
    restore.add_argument("--to", required=True, metavar="DIR", help="a new or empty folder")
    data.set_defaults(fn=_data)
    run = sub.add_parser("run", parents=[common],
                         help="the whole pipeline as dvc.yaml chains it (prepare, validate, train, refine, "
                              "evaluate, register, index; stops if validation fails), then the summary")
    run.add_argument("--until", choices=[name for name, _ in CHAIN], default=None, metavar="STAGE",
                     help="stop after this stage (one of: %(choices)s)")
    run.add_argument("--force", action="store_true",
                     help="train even if the data (a DVC snapshot) and params equal the champion's")
    run.set_defaults(fn=_stage_run)
    sub.add_parser("summary", parents=[common],
                   help="what the last pipeline run did, from the files its stages wrote").set_defaults(fn=_summary)
    tune = sub.add_parser("tune", parents=[common],
                          help="Optuna study over tune.space, scored by validation R@1 -> params.tuned.yaml")
    mode = tune.add_mutually_exclusive_group()
    mode.add_argument("--workers", type=_positive_int, default=1, metavar="N",
                      help="worker processes on this machine (journal storage unless tune.storage is set)")
    mode.add_argument("--worker", action="store_true",
                      help="join the study in tune.storage as one more worker (e.g. from another machine)")
    tune.add_argument("--apply", action="store_true", help="merge the best values into the --params file")
    tune.set_defaults(fn=_stage_tune)
    index = sub.add_parser("index", parents=[common],
                           help="faiss index of the catalogue (index.source) with models/model.pt, attached to "
                                "its registry version")
    index.add_argument("--append", action="store_true",
                       help="add only the catalogue images not in the index yet (nothing is re-embedded)")
    index.add_argument("--shards", nargs="+", default=None, metavar="FILE.parquet",
                       help="build an on-disk IVF index (index.type ivf_flat|ivf_pq) from `xbn embed` outputs, "
                            "for a catalogue larger than one machine's memory")
    index.add_argument("--model-version", type=_positive_int, default=None, metavar="V",
                       help="index with registry version V's own checkpoint instead of models/model.pt (a "
                            "version to promote by hand, or a champion whose index was lost)")
    index.set_defaults(fn=_stage_index)
    # Which model serves: the registry's serve.alias (champion) unless a version or the local files are named.
    which = argparse.ArgumentParser(add_help=False)
    where = which.add_mutually_exclusive_group()
    where.add_argument("--model-version", type=_positive_int, default=None, metavar="V",
                       help="this registry version instead of the champion")
    where.add_argument("--local", action="store_true",
                       help="models/model.pt with the index at index.output instead of the registry")
    search = sub.add_parser("search", parents=[common, which],
                            help="the catalogue's nearest images to each IMAGE (champion's index by default)")
    search.add_argument("images", nargs="+", metavar="IMAGE")
    search.add_argument("--k", type=_positive_int, default=None, help="neighbours per image (serve.default_k)")
    search.set_defaults(fn=_search)
    serve = sub.add_parser("serve", parents=[common, which],
                           help="HTTP endpoint (POST /search, /embed; GET /health) following the champion; "
                                "token from XBN_SERVE_TOKEN or XBN_SERVE_TOKEN_FILE")
    serve.add_argument("--host", default=None, help="bind address (serve.host, 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (serve.port, 8000)")
    serve.set_defaults(fn=_serve)
    embed = sub.add_parser("embed", parents=[common, which],
                           help="batch embedding job: a folder or manifest CSV -> parquet (resumes after a kill)")
    embed.add_argument("--input", required=True, metavar="DIR|CSV")
    embed.add_argument("--output", required=True, metavar="FILE.parquet")
    embed.set_defaults(fn=_embed)
    export = sub.add_parser("export", parents=[common],
                            help="models/model.pt as ONNX (dynamic batch), parity-checked, attached to its version")
    export.add_argument("--format", choices=["onnx"], default="onnx")
    export.add_argument("--output", default=None, help="default: models/model.onnx")
    export.set_defaults(fn=_export)
    return parser


# The commands that are a stage of the run (their params recorded for the later ones), and the later readers.
STAGE_COMMANDS = {name for name, _ in CHAIN}
RECORD_READERS = STAGE_COMMANDS | {"summary"}


def _init(args) -> int:
    try:
        path = init(args.dataset, args.root, args.overrides, labels_file=args.labels_file, force=args.force)
    except ConfigError as exc:
        print(f"xbn init: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except PermissionError as exc:  # a read-only folder: one line, not a traceback
        print(f"xbn init: cannot write here: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"wrote {path} for the {args.dataset} dataset at {args.root}; next: xbn run")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fix_malloc_thresholds()  # torch's buffers on the heap, not a fresh mmap each batch (see there)
    rank = os.environ.get("RANK")  # set by torchrun for each worker of `xbn train --nproc N`
    configure_logging(verbose=args.verbose, prefix=f"xbn {args.command}{f' [rank {rank}]' if rank else ''}: ",
                      level=logging.INFO if rank in (None, "0") else logging.WARNING)
    set_quiet(getattr(args, "quiet", False) or rank not in (None, "0"))  # the bars of the slow steps
    if args.command == "init":
        return _init(args)
    try:
        if args.command == "train":
            args.nodes = _train_nodes(args)
        if args.command in RECORD_READERS:  # the run's own params, not only the params file's

            # `xbn run` starts a run: nothing before it to agree with.
            stage = "prepare" if args.command == "run" else args.command if args.command in STAGE_COMMANDS else None
            params = resolve_params(args.params, args.overrides, stage)
        else:
            params = load_params(args.params, args.overrides)
        if args.command in RESOLVES_NAMES:
            check_names(params)
    except ConfigError as exc:
        print(f"xbn: {exc}", file=sys.stderr)
        return EXIT_CONFIG

    exit_codes = (
        # a check that needs more than the schema (e.g. a tune.space bound), or a bad XBN_CPU_BF16
        ((ConfigError, EnvironmentSettingError), EXIT_CONFIG),
        # FileExistsError: data.root not ours; IntegrityError: a model file is not the one written or registered
        ((DatasetError, FileNotFoundError, FileExistsError, IntegrityError), EXIT_DATA),
        ((ServiceUnavailableError,), EXIT_SERVICE),  # the tracking store is down: nothing was started
        # Nothing to serve or to roll back to, an unknown version, no index attached; a non-finite loss (the
        # message names the iteration; the last good checkpoint is kept).
        # PermissionError: a read-only working folder or output (the message names the file). RunBusy: another
        # run on the same model holds the run lock; LockLost: the lock died with its database connection.
        ((RegistryError, NonFiniteLossError, TrainingStalledError, PermissionError, RunBusy, LockLost),
         EXIT_FAILURE),
    )
    try:
        with _run_lock(params, args.command):
            if args.command in STAGE_COMMANDS:
                result = _recorded(args.command, args.fn, params, args)
            else:
                result = args.fn(params, args)
    except tuple(kind for kinds, _ in exit_codes for kind in kinds) as exc:
        said, prefix = str(exc), f"xbn {args.command}: "
        if isinstance(exc, PermissionError) and exc.filename and not os.path.isabs(str(exc.filename)):
            said += f" (in {os.getcwd()}: a folder this account cannot write in)"
        said = said if said.startswith(prefix) else prefix + said  # RunBusy names its command
        print(mask_secrets(said), file=sys.stderr)
        return next(code for kinds, code in exit_codes if isinstance(exc, kinds))
    except Exception as exc:  # noqa: BLE001 - printed masked, then exit 1: the traceback stays for a bug report
        if "mlflow" in sys.modules:
            from mlflow.exceptions import MlflowException

            from xbn.tracking.services import access_denied

            if (line := access_denied(exc)) is not None:  # an MLflow 401/403: the account's settings, exit 2
                print(f"xbn {args.command}: {line}", file=sys.stderr)
                return EXIT_CONFIG
            if isinstance(exc, MlflowException) and " failed with exception " in str(exc):  # the store dropped
                print(mask_secrets(f"xbn {args.command}: the MLflow tracking store failed a request, after "
                                   f"MLflow's retries: {str(exc).splitlines()[0][:600]}"), file=sys.stderr)
                return EXIT_SERVICE
        # A failure xbn has no name for: its traceback, every credential masked (MLflow's messages carry the
        # tracking URI, password included, and a traceback is a log someone keeps).
        print(mask_secrets("".join(traceback.format_exception(exc))).rstrip(), file=sys.stderr)
        return EXIT_FAILURE
    if result is None:  # a command that ran until stopped (serve)
        return 0
    try:
        _print_result(result, args)
        sys.stdout.flush()
    except BrokenPipeError:  # `xbn summary | head -3`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
    return 0


if __name__ == "__main__":
    sys.exit(main())
