"""Stage `register` and the registry jobs behind `xbn registry review|promote|rollback`.

`register` adds the trained model (the run's pyfunc) as a new version of `registry.model_name` with alias
`challenger`, and lets the promotion gate (`xbn.stages.gate`) decide whether it becomes `champion`: the
challenger and the champion are both embedded on the validation split (`registry.gate_split`) of the current
data and compared query by query with a paired bootstrap; the first model is promoted, a challenger without a
`val` split to compare on is `held`, and otherwise it is `promoted` only if the interval's lower bound clears
`registry.min_improvement` and no guarded metric falls by more than `registry.tolerance`, else `rejected`.
The test split's metrics (`eval.output`) are recorded with the version for reporting only (they never decide a
promotion): as its logged model's metrics on dataset `test` (and the run's), in the model card and the review
table.
A version that becomes champion loses the `challenger` alias and records the champion it replaced as tag
`previous_champion`, which `rollback` restores. Every decision is written as version tags (`decision`,
`decided_by`, `decided_at`, `reason`) and to `registry.report`; the gate's comparison as the tags
`<split>_<metric>` (the challenger's primary metric on the gate split) and `gate_interval` (the interval in
short), in full (JSON) on the logged model (tag `gate`) and in the model card.
The version tags are only what a reviewer scans across versions in the MLflow UI's versions table (see the
comment at `GATE_INTERVAL_TAG`); the rest is in the model card (the version's description) and on the logged
model.
All MLflow access goes through `xbn.tracking`.
"""

from __future__ import annotations

import getpass
import json
import os
import re
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from xbn.config import Params, RegistryConfig, flatten
from xbn.stages.gate import Comparison, Decision, Gate, report_metrics
from xbn.tracking import (
    ModelVersionInfo,
    PipelineRun,
    Registry,
    data_hash,
    file_digest,
    log_model,
    params_hash,
    pipeline_run,
    run_summary,
    scores_of,
)
from xbn.tracking.registry import SERVED_TAG, SHA_TAG, log_refiner
from xbn.tracking.runs import metric_key
from xbn.tracking.services import mask_secrets
from xbn.utils.io import write_json

CHAMPION, CHALLENGER = "champion", "challenger"
GATE = "gate"  # `decided_by` of the automatic decisions
# The params a reader of the model card wants first; the full set is in the run.
KEY_PARAMS = ("data.dataset", "data.image_size", "model.backbone", "model.pretrained", "model.embedding_dim",
              "memory.method", "memory.size", "loss.name", "loss.memvir.enabled", "train.epochs",
              "train.warmup_epochs", "train.lr", "train.batch_size", "train.samples_per_class", "train.seed")
GATE_INTERVAL_TAG = "gate_interval"  # the comparison in short: `+0.0120 [-0.0040, +0.0290] vs v2`
# A version's tags are what a reviewer scans across versions in the MLflow UI's versions table, in the order
# it lists them: `decision`, `decided_by`, the gate's result when compared (`val_recall_at_1`,
# `gate_interval`), `data_hash`, `params_hash`, `model_sha256`, `served_embedding`, then `decided_at` and
# `reason`; `previous_champion` is added when the version replaces a champion. Everything else is in the model
# card and on the logged model (`Registry.record`). The set is pinned by tests/tracking/test_registry.py.


def register(params: Params) -> dict:
    """Register `models/model.pt` (tagged with the test metrics of `eval.output`, for reporting), apply the
    promotion gate on the validation split, write `registry.report`.

    Idempotent: a model whose sha256 is already registered is reported (with its recorded decision) and
    nothing is created or changed.
    """
    cfg = params.registry
    checkpoint = Path(params.train.checkpoint_dir) / "model.pt"
    results_file = Path(params.eval.output)
    for path, stage in ((checkpoint, "train"), (results_file, "evaluate")):
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: run `xbn {stage}` first")
    results = json.loads(results_file.read_text())
    # Seed 001: when the refine stage serves refined queries, the gate judges (and the tags record) those.
    served = "refined" if (results.get("refined") or {}).get("served") else "plain"
    metrics = scores_of(results["refined"] if served == "refined" else results)
    if cfg.primary_metric not in metrics:
        raise ValueError(f"registry.primary_metric '{cfg.primary_metric}' is not in {results_file} "
                         f"(it has {', '.join(sorted(metrics))})")
    sha = file_digest(checkpoint)
    registry = Registry(params)
    if existing := registry.find_by_tag(SHA_TAG, sha):
        return _write_report(params, registry, existing, compared=None, already_registered=True)

    data = data_hash(params) or "unknown"
    gate = Gate(params, checkpoint)
    with pipeline_run(params, "register") as run:
        # The slow parts outside the lock: logging the model, embedding the val split with both models.
        model_uri = log_model(params, run, checkpoint)
        if served == "refined":
            log_refiner(run, params.refine.output)
        gate.decide(registry.by_alias(CHAMPION), registry)
        # Read the champion, decide and move the aliases under the registry lock: a concurrent register or
        # promote may have changed the champion (or registered this very file) since the check above; the
        # gate then compares with the new champion (else its comparison above is reused).
        with registry.lock():
            if existing := registry.find_by_tag(SHA_TAG, sha):
                return _write_report(params, registry, existing, compared=None, already_registered=True)
            champion = registry.by_alias(CHAMPION)
            decision = gate.decide(champion, registry)
            comparison = decision.comparison
            # The metrics and the comparison first, then the version with its decision: no version is ever
            # seen without them. Under the keys evaluate logged them to the run (refined: `refined/...`).
            registry.record(model_uri, run.run_id, metrics, params.eval.split, data,
                            prefix="refined/" if served == "refined" else "",
                            gate=comparison.as_dict() if comparison else None)
            stamp = _stamp(decision.decision, decision.reason, GATE)
            tags = {"decision": stamp.pop("decision"), "decided_by": stamp.pop("decided_by"),
                    **_gate_tags(comparison), "data_hash": data, "params_hash": params_hash(params),
                    SHA_TAG: sha, SERVED_TAG: served, **stamp}
            version = registry.create(model_uri, tags).version
            registry.set_alias(CHALLENGER, version)
            if decision.promote:
                _make_champion(registry, version, champion)
        registry.set_description(version, model_card(params, registry.get(version), champion, decision, run))
    return _write_report(params, registry, registry.get(version), compared=champion)


def promote(params: Params, version: int | str, reason: str, user: str | None = None) -> dict:
    """Move `champion` to `version` by hand (the promotion gate does not apply); idempotent."""
    _require_reason(reason)
    registry = Registry(params)
    with registry.lock():  # the champion read here is still the champion when the alias moves
        target = registry.get(version)
        champion = registry.by_alias(CHAMPION)
        if champion is not None and champion.version == target.version:
            return _write_report(params, registry, target, compared=None, decision="unchanged",
                                 reason=f"v{target.version} is already the champion; nothing changed")
        _make_champion(registry, target.version, champion)
        registry.set_tags(target.version, _stamp("promoted", reason, _user(user)))
    return _write_report(params, registry, registry.get(target.version), compared=champion)


def rollback(params: Params, reason: str, user: str | None = None) -> dict:
    """Restore the champion that the current one replaced (its `previous_champion` tag)."""
    _require_reason(reason)
    registry = Registry(params)
    with registry.lock():
        champion = registry.by_alias(CHAMPION)
        if champion is None:
            raise ValueError(f"{params.registry.model_name} has no champion to roll back")
        previous = champion.tags.get("previous_champion")
        if not previous:
            raise ValueError(f"champion v{champion.version} records no previous champion to roll back to")
        who = _user(user)
        registry.set_alias(CHAMPION, int(previous))
        registry.set_tags(champion.version, _stamp("rolled_back", reason, who))
        registry.set_tags(int(previous),
                          _stamp("restored", f"rollback of v{champion.version}: {reason}", who))
    return _write_report(params, registry, registry.get(previous), compared=champion)


def review(params: Params) -> str:
    """A side-by-side text table of the champion and the challenger (or, without a challenger, the champion
    the current one replaced): metrics with differences, hashes, dates and decision tags."""
    cfg = params.registry
    registry = Registry(params)
    champion, challenger = registry.by_alias(CHAMPION), registry.by_alias(CHALLENGER)
    other_title = CHALLENGER
    if challenger is None and champion is not None and champion.tags.get("previous_champion"):
        challenger, other_title = registry.get(champion.tags["previous_champion"]), "previous champion"
    if champion is None and challenger is None:
        return f"{cfg.model_name}: no champion and no challenger registered yet"
    columns = [(CHAMPION, champion), (other_title, challenger)]
    base = champion.metrics if champion else {}

    def metric_cell(info: ModelVersionInfo | None, name: str) -> str:
        if info is None or name not in info.metrics:
            return "-"
        value = info.metrics[name]
        if info is champion or name not in base:
            return f"{value:.4f}"
        return f"{value:.4f} ({value - base[name]:+.4f})"

    names = _ordered({n for _, info in columns if info for n in info.metrics}, cfg)
    rows: list[tuple[str, list[str]]] = [("", [f"{title} v{info.version}" if info else f"{title}: none"
                                               for title, info in columns])]
    rows += [("created", [_cell(info, lambda i: i.created_at) for _, info in columns])]
    rows += [(_mark(n, cfg), [metric_cell(info, n) for _, info in columns]) for n in names]
    for label, key, n in (("params hash", "params_hash", 12), ("data hash", "data_hash", 12),
                          ("model sha256", "model_sha256", 12), ("decision", "decision", 40),
                          ("decided by", "decided_by", 40), ("decided at", "decided_at", 40),
                          ("previous champion", "previous_champion", 40)):
        cells = [_cell(info, lambda i, k=key, n=n: _short(i.tags.get(k), n)) for _, info in columns]
        rows.append((label, cells))
    rows.append(("run", [_cell(info, lambda i: _short(i.run_id, 12)) for _, info in columns]))
    width = max(len(label) for label, _ in rows) + 2
    cell_w = max(len(c) for _, cells in rows for c in cells) + 2
    lines = [f"{cfg.model_name}"]
    lines += [label.ljust(width) + "".join(c.ljust(cell_w) for c in cells).rstrip() for label, cells in rows]
    lines.append(f"metrics above: split {params.eval.split}, for reporting only. Promotion is decided on "
                 f"{cfg.gate_split}: * primary metric, {_required(cfg)}; + guarded, may fall by at most "
                 f"{cfg.tolerance:g} on {cfg.gate_split}")
    for title, info in columns:
        if info is not None and (gate := _gate_line(info)):
            lines.append(f"{title} v{info.version} gate: {gate}")
    for title, info in columns:
        if info is not None and info.tags.get("reason"):
            lines.append(f"{title} v{info.version} reason: {info.tags['reason']}")
    return "\n".join(lines)


def model_card(params: Params, version: ModelVersionInfo, champion: ModelVersionInfo | None,
               decision: Decision, run: PipelineRun) -> str:
    """The version's description (Markdown): metrics beside the champion's, data version, key params,
    links to the run, the model and the retrieval grid."""
    cfg = params.registry
    summary = run_summary(run.run_id, params)
    metrics, champ = version.metrics, champion.metrics if champion else {}
    vs = f"champion v{champion.version}" if champion else "champion (none)"
    lines = [f"# {version.name} v{version.version}", "",
             f"**Decision:** {decision.decision} ({GATE}): {decision.reason}", ""]
    lines += _gate_section(decision.comparison, version, cfg)
    lines += ["## Test metrics (reporting only)",
              f"Split `{params.eval.split}`, from `{params.eval.output}`; never used to promote. The "
              f"champion's values are from its own registration, possibly on other data.", "",
              f"| metric | v{version.version} | {vs} | change |", "|---|---:|---:|---:|"]
    for name in _ordered(metrics.keys() | champ.keys(), cfg):
        mine, theirs = metrics.get(name), champ.get(name)
        change = f"{mine - theirs:+.4f}" if mine is not None and theirs is not None else ""
        lines.append(f"| {_mark(name, cfg)} | {_num(mine)} | {_num(theirs)} | {change} |")
    champion_hash = champion.tags.get("data_hash") if champion else None
    if champion is None:
        same = ""
    elif champion_hash == version.tags.get("data_hash"):
        same = " (same as the champion's)"
    else:
        same = f" (champion: `{champion_hash}`)"
    flat = flatten(params)
    lines += ["", "## Data",
              f"{params.data.dataset} at `{params.data.root}`: promotion decided on split "
              f"`{cfg.gate_split}`, reported on split `{params.eval.split}`; manifest "
              f"`{params.data.manifest}` md5 "
              f"`{version.tags.get('data_hash')}`{same}.",
              "", "## Key params", *(f"- `{k}`: {flat[k]}" for k in KEY_PARAMS if k in flat),
              f"- params hash: `{version.tags.get('params_hash')}`",
              f"- git commit: `{summary['tags'].get('git_commit', 'unknown')}`",
              "", "## Links", f"- run: `runs:/{run.run_id}` (experiment {summary['experiment_id']})",
              f"- model: `{version.source}` (model.pt sha256 `{version.tags.get('model_sha256')}`)"]
    if run.tracking_uri.startswith(("http://", "https://")):
        ui = mask_secrets(run.tracking_uri).rstrip("/")  # the card is public to every registry reader
        lines.append(f"- run in the UI: {ui}/#/experiments/{run.experiment_id}"
                     f"/runs/{run.run_id}")
    grid = "plots/retrieval_grid.png"
    lines.append(f"- retrieval grid: {summary['artifact_uri']}/{grid}" if grid in summary["artifacts"]
                 else "- retrieval grid: not logged for this run")
    return "\n".join(lines) + "\n"


# -- helpers -----------------------------------------------------------------------------------------------
def _gate_tags(comparison: Comparison | None) -> dict[str, str]:
    """The gate's result as a reviewer scans it in a narrow table cell: the challenger's primary metric on the
    gate split (tag `val_recall_at_1`: MLflow keys cannot hold '@') and the interval, numbers first. The full
    statement is in the model card, the reason and `review`."""
    if comparison is None:
        return {}
    c = comparison
    value = c.challenger.get(c.metric)
    primary = {} if value is None else {f"{c.split}_{metric_key(c.metric)}": f"{value:.4f}"}
    return {**primary, GATE_INTERVAL_TAG: c.short()}


def _gate_line(info: ModelVersionInfo) -> str | None:
    """The gate's full statement about `info` (from its recorded comparison; the tag of a version registered
    when the tag held the full statement)."""
    if info.gate is None:
        return info.tags.get(GATE_INTERVAL_TAG)
    c = Comparison.from_dict(info.gate)
    return f"{c.interval()} vs champion v{c.champion_version}"


def _gate_section(comparison: Comparison | None, version: ModelVersionInfo, cfg: RegistryConfig) -> list[str]:
    """The model card's account of the gate: the interval and both models' metrics on the gate split."""
    if comparison is None:
        return []
    c = comparison
    lines = ["## Promotion gate", f"{c.interval()} vs champion v{c.champion_version}, seed {c.seed}: "
             f"mean(challenger - champion) of the per-query {c.metric} and its percentile interval; both "
             f"models embedded on the current `{c.split}` rows.", "",
             f"| metric on {c.split} | v{version.version} | champion v{c.champion_version} | change |",
             "|---|---:|---:|---:|"]
    mine, theirs = report_metrics(c.challenger, cfg), c.champion
    for name in _ordered(mine.keys(), cfg):
        other = theirs.get(name)
        change = f"{mine[name] - other:+.4f}" if other is not None else ""
        lines.append(f"| {_mark(name, cfg)} | {_num(mine[name])} | {_num(other)} | {change} |")
    return [*lines, ""]


def _make_champion(registry: Registry, version: int, champion: ModelVersionInfo | None) -> None:
    if champion is not None and champion.version != version:
        registry.set_tags(version, {"previous_champion": champion.version})
    registry.set_alias(CHAMPION, version)
    challenger = registry.by_alias(CHALLENGER)
    if challenger is not None and challenger.version == version:  # it is no longer a challenger
        registry.remove_alias(CHALLENGER)


def _write_report(params: Params, registry: Registry, info: ModelVersionInfo,
                  compared: ModelVersionInfo | None, already_registered: bool = False,
                  decision: str | None = None, reason: str | None = None) -> dict[str, Any]:
    champion = registry.by_alias(CHAMPION)
    previous = info.tags.get("previous_champion")
    report = {
        "model_name": info.name,
        "version": info.version,
        "alias": ",".join(info.aliases) or None,
        "decision": decision or info.tags.get("decision"),
        "reason": reason or info.tags.get("reason"),
        "decided_by": info.tags.get("decided_by"),
        "decided_at": info.tags.get("decided_at"),
        "metrics": info.metrics,  # the test split's, for reporting
        "gate": info.gate,
        "champion_version": champion.version if champion else None,
        "compared_with": {"version": compared.version, "metrics": compared.metrics} if compared else None,
        "previous_champion": int(previous) if previous else None,
        "data_hash": info.tags.get("data_hash"),
        "params_hash": info.tags.get("params_hash"),
        "model_sha256": info.tags.get(SHA_TAG),
        "run_id": info.run_id,
        "already_registered": already_registered,
    }
    write_json(params.registry.report, report)
    return report


def _required(cfg: RegistryConfig) -> str:
    return (f"the lower bound of its {cfg.confidence * 100:g}% paired-bootstrap interval (challenger - "
            f"champion) must exceed {cfg.min_improvement:+g}")


def _stamp(decision: str, reason: str, who: str) -> dict[str, str]:
    return {"decision": decision, "decided_by": who,
            "decided_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "reason": reason}


def _user(user: str | None) -> str:
    if user:
        return user
    try:
        return os.environ.get("USER") or getpass.getuser()
    except (KeyError, OSError):  # no $USER and no passwd entry (some containers)
        return "unknown"


def _require_reason(reason: str) -> None:
    if not reason or not reason.strip():
        raise ValueError("a reason is required: it is recorded with the decision")


def _ordered(names: Iterable[str], cfg: RegistryConfig) -> list[str]:
    """Primary metric first, then the guarded ones, then the rest in natural order (recall@2 before @10)."""
    names = set(names)
    head = [n for n in (cfg.primary_metric, *cfg.guarded_metrics) if n in names]
    def natural(name: str) -> list:
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]

    return list(dict.fromkeys(head)) + sorted(names - set(head), key=natural)


def _mark(name: str, cfg: RegistryConfig) -> str:
    return name + (" *" if name == cfg.primary_metric else " +" if name in cfg.guarded_metrics else "")


def _cell(info: ModelVersionInfo | None, get) -> str:
    return "-" if info is None else (get(info) or "-")


def _short(value: Any, n: int = 12) -> str:
    return "-" if value in (None, "") else str(value)[:n]


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
