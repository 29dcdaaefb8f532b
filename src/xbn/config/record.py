"""One source of truth per run: `reports/params.resolved.yaml`, the params the run's stages resolved.

Every stage the `xbn` command runs writes the params it resolved (params file + `--set`) there, with the
stages of the run so far, the way dvc.lock records a pipeline's params. A later stage of the same run (run by
hand, `xbn summary`, `xbn register`, `xbn index`) takes the keys the earlier stages depended on from the
record, not from the params file: a `--set data.root=...` given to `xbn run` is then not forgotten by the
next command. Its own `--set` of such a key with another value is refused (ConfigError, one line): the model
on disk was not made with it. A stage writes the record afresh for itself and the stages before it; the
stages after it are dropped, since their outputs are now stale.

Under `dvc repro` the record always agrees with params.yaml (DVC reruns an upstream stage whose params
changed before the stages after it), so it changes nothing there.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from xbn.config.errors import ConfigError
from xbn.config.loading import flatten, load_params
from xbn.config.schema import Params
from xbn.utils.io import write_text
from xbn.utils.secrets import mask_secrets

log = logging.getLogger(__name__)

RECORD = Path("reports/params.resolved.yaml")
SCHEMA = "xbn-params-record/1"
# The pipeline's stages in dvc.yaml's order, and the params keys (dotted prefixes) each depends on.
STAGES = ("prepare", "validate", "train", "refine", "evaluate", "register", "index")
OWNS: dict[str, tuple[str, ...]] = {
    "prepare": ("data.dataset", "data.root", "data.labels_file", "data.manifest", "data.val_classes",
                "data.split_seed", "data.glyphs."),
    "validate": ("validate.",),
    "train": ("data.", "model.", "memory.", "loss.", "train.", "tracking."),
    "refine": ("refine.",),
    "evaluate": ("eval.",),
    "register": ("registry.",),
    "index": ("index.",),
}
# Keys that leave a stage's results as they are: a later stage may set them as it likes.
FREE = {"data.num_workers", "train.device"}
HEADER = ("# The params this run's stages resolved (params file + --set), written by `xbn` before each stage;\n"
          "# the run's later stages (`xbn summary`, `register`, `index`, ...) read it. Not to be edited: run the\n"
          "# stage again (or `xbn run`) instead.\n")


def read_record(path: str | Path = RECORD) -> dict | None:
    """The record, or None when there is none (or it is not one: a warning, and it is ignored)."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        record = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        record = None
    if not (isinstance(record, dict) and record.get("schema") == SCHEMA and isinstance(record.get("params"), dict)):
        log.warning("%s is not a params record written by xbn: ignored", path)
        return None
    return record


def completed(record: dict | None, before: str | None = None) -> list[str]:
    """The stages the record holds as done (those before stage `before`, when given), in pipeline order."""
    if record is None:
        return []
    done = [s for s, info in (record.get("stages") or {}).items()
            if s in STAGES and isinstance(info, dict) and info.get("status") == "done"]
    limit = STAGES.index(before) if before in STAGES else len(STAGES)
    return [s for s in STAGES if s in done and STAGES.index(s) < limit]


def _fixed(key: str, stages: list[str]) -> str | None:
    """The earlier stage whose params include `key` (None: the key is free for this stage)."""
    if key in FREE:
        return None
    for stage in stages:
        if any(key == p or key.startswith(p if p.endswith(".") else p + ".") or key + "." == p
               for p in OWNS[stage]):
            return stage
    return None


def _get(tree: dict, key: str, missing: Any = None) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return missing
        node = node[part]
    return node


def _set(tree: dict, key: str, value: Any) -> None:
    *sections, leaf = key.split(".")
    for part in sections:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _delete(tree: dict, key: str) -> None:
    *sections, leaf = key.split(".")
    for part in sections:
        tree = tree.get(part, {})
    tree.pop(leaf, None)


def resolve_params(path: str | Path | None, overrides: list[str] | None, stage: str | None,
                   record_path: str | Path = RECORD) -> Params:
    """The params of `stage` (a name of STAGES, or None for a reader after all of them, such as `summary`):
    the params file with `overrides`, then, for every key a stage the record holds as done before this one
    depended on, the record's value. An override of such a key with another value raises ConfigError."""
    params = load_params(path, overrides)
    record = read_record(record_path)
    earlier = completed(record, stage)
    if record is None or not earlier:
        return params
    recorded: dict = record["params"]
    mine = params.model_dump(mode="json")
    for item in overrides or []:
        key = item.partition("=")[0].strip()
        owner = _fixed(key, earlier)
        if owner and _get(mine, key) != _get(recorded, key, missing=_get(mine, key)):
            raise ConfigError(
                f"--set {key}={_get(mine, key)!r} contradicts this run's {key}={_get(recorded, key)!r}, which "
                f"`xbn {owner}` used ({record_path}): drop the --set, or run again from `xbn {owner}` "
                f"(or `xbn run`) with it")
    merged, taken, gone = mine, [], object()
    for key, value in flatten(recorded).items():
        if _fixed(key, earlier) and _get(mine, key, missing=gone) != value:
            _set(merged, key, value)
            taken.append(key)
    for key in flatten(mine):  # a free-form mapping's entry the run did not have (e.g. in loss.params)
        if _fixed(key, earlier) and _get(recorded, key, missing=gone) is gone:
            _delete(merged, key)
            taken.append(key)
    if taken:
        shown = ", ".join(f"{k}={_get(recorded, k)!r}" for k in taken[:4]) + (" ..." if len(taken) > 4 else "")
        log.info("using this run's %s (from %s, not %s)", shown, record_path, path or "the defaults")
    try:
        return Params.model_validate(merged)
    except ValidationError as err:  # a record from another xbn version whose keys no longer fit
        raise ConfigError(f"{record_path} no longer fits the params schema ({err.errors()[0]['msg']}): "
                          f"run the pipeline again (`xbn run`)") from None


def write_record(params: Params, stage: str, status: str, params_file: str | Path | None,
                 overrides: list[str] | None, record_path: str | Path = RECORD, reason: str | None = None) -> None:
    """Record `params` as resolved by `stage`, with `status` (running, done or failed): the stages before it
    keep their entries, the ones after it are dropped. Written atomically."""
    record = read_record(record_path) or {}
    kept = {s: info for s, info in (record.get("stages") or {}).items()
            if s in STAGES and STAGES.index(s) < STAGES.index(stage)}
    entry: dict[str, Any] = {"status": status, "overrides": list(overrides or []),
                             "at": datetime.now(UTC).isoformat(timespec="seconds")}
    if reason:
        entry["reason"] = mask_secrets(reason.splitlines()[0][:300] if reason.strip() else reason)
    out = {"schema": SCHEMA, "params_file": None if params_file is None else str(params_file),
           "stages": {**kept, stage: entry}, "params": params.model_dump(mode="json")}
    write_text(record_path, HEADER + yaml.safe_dump(out, sort_keys=False, width=120))


def stage_status(record: dict | None, stage: str) -> dict | None:
    """The record's entry for `stage` ({status, overrides, at[, reason]}), or None."""
    info = ((record or {}).get("stages") or {}).get(stage)
    return info if isinstance(info, dict) else None


__all__ = ["RECORD", "STAGES", "completed", "read_record", "resolve_params", "stage_status", "write_record"]
