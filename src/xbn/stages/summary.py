"""What a pipeline run did, on one screen: `xbn summary` (the end of `make run`) and the retrain flow's
Prefect artifact. Generated from the files the stages wrote, so it says what is on disk, not what a process
remembers: the dataset and its size, the memory method, test R@1 and MAP@R (trained against untrained), the
registry's decision with its reason and version, the files to open and how to browse the runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from xbn.config import Params
from xbn.config.record import read_record, stage_status
from xbn.data.snapshot import current_record
from xbn.utils.secrets import mask_secrets


def _read(path: str | Path) -> dict[str, Any] | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def summary_rows(params: Params) -> list[tuple[str, str]]:
    """(label, text) pairs, in reading order; a stage that has not run says so. With the run's record
    (reports/params.resolved.yaml), only the files of the stages it holds as done are read: the outputs of
    an earlier run, or of a stage that failed, are not this run's."""
    record = read_record()

    def done(stage: str) -> bool:
        return record is None or (stage_status(record, stage) or {}).get("status") == "done"

    validation = _read(params.validate.report) if done("validate") else None
    train = _read(Path(params.train.metrics_dir) / "train.json") if done("train") else None
    evaluation = _read(params.eval.output) if done("evaluate") else None
    registry = _read(params.registry.report) if params.tracking.enabled and done("register") else None
    indexed = _read(params.index.metrics) if registry and done("index") else None
    rows: list[tuple[str, str]] = []
    for stage, info in ((record or {}).get("stages") or {}).items():
        if isinstance(info, dict) and info.get("status") != "done":
            rows.append(("FAILED" if info.get("status") == "failed" else "running",
                         f"xbn {stage}: {info.get('reason') or 'did not finish'}"))

    data = f"{params.data.dataset} at {params.data.root}"
    if validation and (validation.get("summary") or {}).get("splits"):
        splits = validation["summary"]["splits"]
        sizes = ", ".join(f"{s} {v['classes']} classes / {v['images']} images" for s, v in splits.items())
        status = "passed" if validation.get("success") else "FAILED"
        data += f" ({sizes}); validation {status}"
    rows.append(("data", data))
    if snapshot := current_record(params):  # the retrain flow's DVC snapshot, when it describes this data
        rows.append(("data version", f"DVC md5 {snapshot.md5}, {snapshot.nfiles} files, pushed to {snapshot.remote}"
                     if snapshot.md5 else "not versioned (data.version: none): the images cannot be restored"))

    t = params.train
    memory: str = params.memory.method
    if train:
        memory += f", {train.get('memory_rows', 0)} rows" if memory != "none" else ""
    memory += f"; batch {t.batch_size} ({t.batch_size // t.samples_per_class} classes x {t.samples_per_class})"
    if train:
        best = train.get("best_val_recall@1")
        rows.append(("training", f"{train.get('epochs')} epochs, {train.get('iterations')} iterations, best epoch "
                                 f"{train.get('best_epoch')} (val R@1 {_num(best)})"
                                 + (f", {train['train_seconds']:.0f} s" if "train_seconds" in train else "")))
        if drift := train.get("memory_drift"):  # seed 000 Fig. 2: did the map bring the stale rows nearer?
            rows.append(("memory drift", memory_drift_line(drift, params.memory.method)))
        rows += [("WARNING", w.split("] ", 1)[-1]) for w in train.get("warnings") or []]
    rows.insert(next(i for i, (label, _) in enumerate(rows) if label == "data") + 1, ("memory", memory))

    if evaluation:
        untrained = evaluation.get("untrained") or {}
        line = f"R@1 {_num(evaluation.get('recall@1'))}  MAP@R {_num(evaluation.get('map@r'))}"
        if untrained:
            line += (f"  (untrained: R@1 {_num(untrained.get('recall@1'))}  MAP@R "
                     f"{_num(untrained.get('map@r'))})")
        rows.append((f"{params.eval.split} split", line))
    else:
        rows.append((f"{params.eval.split} split", f"not evaluated ({params.eval.output} missing)"))

    if registry:
        decision = f"v{registry.get('version')} {registry.get('decision')}: {registry.get('reason')}"
        if registry.get("registration") == "awaiting_index":  # promote last: the index stage completes it
            decision += (f" (champion once its index is attached; v{registry.get('champion_version')} serves)"
                         if not (indexed and indexed.get("version") == registry.get("version")
                                 and indexed.get("champion")) else " (champion: its index is attached)")
        elif registry.get("champion_version") is not None:
            decision += f" (champion: v{registry['champion_version']})"
        rows.append(("registry", decision))
    elif params.tracking.enabled:
        rows.append(("registry", f"not registered ({params.registry.report} missing)"))

    files = [params.validate.report_text, str(Path(params.train.metrics_dir) / "train_epochs.csv"),
             params.eval.output]
    rows.append(("files", ", ".join(f for f in files if Path(f).exists()) or "none yet"))
    if params.tracking.enabled:
        # xbn.tracking.tracking_uri's rule, without importing MLflow (seconds) for one line.
        # Masked: the summary is a Prefect artifact, readable by everyone who reads the flow runs (issue 41).
        uri = mask_secrets(os.environ.get("MLFLOW_TRACKING_URI") or params.tracking.uri)
        browse = (f"mlflow ui --backend-store-uri {uri}" if not uri.startswith(("http://", "https://"))
                  else uri)
        rows.append(("runs", (f"{browse}  (the retrieval grid is in the evaluate run's artifacts, "
                             "plots/retrieval_grid.png)")))
    return rows


def summary_text(params: Params) -> str:
    rows = summary_rows(params)
    width = max(len(label) for label, _ in rows)
    return "\n".join(["xbn: summary", *(f"  {label.ljust(width)}  {text}" for label, text in rows)])


def summary_markdown(params: Params) -> str:
    rows = summary_rows(params)
    return "\n".join([f"# xbn retrain: `{params.registry.model_name}`", "", "| | |", "|---|---|",
                      *(f"| {label} | {text.replace('|', '/')} |" for label, text in rows)])


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.4f}"


def memory_drift_line(drift: dict, method: str) -> str:
    """train.json's `memory_drift` in a sentence: how far the stored rows were from fresh embeddings of the same
    views, and whether the map brought them nearer (metrics/train_steps.csv has every check)."""
    line = (f"stored rows {drift['stored_drift_mean']:.3f} from fresh embeddings (cosine "
            f"{drift['stored_cosine']:.4f}, {drift['memory_age']:.0f} steps old on average, {drift['checks']} checks)")
    if drift["mapped_drift_mean"] != drift["stored_drift_mean"]:
        nearer = "nearer" if drift["mapped_drift_mean"] < drift["stored_drift_mean"] else "farther"
        line += (f"; {method}'s map left them {nearer} ({drift['mapped_drift_mean']:.3f}, cosine "
                 f"{drift['mapped_cosine']:.4f}; nearer in {drift['mapped_closer_fraction']:.0%} of the checks)")
    return line
