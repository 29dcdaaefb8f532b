"""The promotion gate of `xbn register`: is the challenger better than the champion, beyond the noise of
which queries happen to be in the evaluation set, on data that decides nothing else?

What is compared. Both models are embedded now, on the `registry.gate_split` (`val`) rows of the current
manifest: the class-disjoint held-out training classes, searched leave-one-out. The test split is never read
here: its metrics (`metrics/eval.json`) are reported beside the decision, never used for it. The challenger is
`models/model.pt`; the champion's checkpoint is downloaded from the registry and verified against the sha256
recorded when it was registered before it is loaded, then embedded at the image size it serves at, with its
own normalisation. Because both models see the same current images, the comparison is valid even when the data
changed since the champion was registered (each version still records its `data_hash`). The embedders are
compared: seed 001's refined queries are not, since the refiner is itself selected on val.

The rule (`decide`):
- no champion: the challenger is promoted (the first model);
- no `val` rows in the manifest: `held` (registered, never promoted automatically);
- otherwise each query's `registry.primary_metric` (R@1: a hit, 1 or 0) of both models on the same queries is
  resampled `registry.bootstrap_resamples` times (a paired bootstrap, `xbn.evaluation.bootstrap`). The
  challenger is `promoted` only if the lower bound of the `registry.confidence` percentile interval of
  mean(challenger - champion) exceeds `registry.min_improvement` and no metric of `registry.guarded_metrics`
  (point estimates on the same split) falls by more than `registry.tolerance`; else `rejected`, the reason
  stating the difference and its interval.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from xbn.config import Params, RegistryConfig
from xbn.data import read_manifest
from xbn.evaluation.bootstrap import bootstrap_means, percentile_interval
from xbn.tracking import ModelVersionInfo, Registry
from xbn.tracking.history import ChampionChange, append_history, read_history
from xbn.tracking.registry import SHA_TAG
from xbn.utils.errors import IntegrityError, RegistryError
from xbn.utils.faults import fault_point
from xbn.utils.io import file_digest

log = logging.getLogger(__name__)

CHAMPION, CHALLENGER = "champion", "challenger"
GATE = "gate"  # `decided_by` of the automatic decisions

_EPS = 1e-12  # absorbs float rounding in the guarded differences only


@dataclass(frozen=True)
class SplitScores:
    """One model on the gate split: its retrieval metrics and, for the queries that have a match, the
    per-query values of the kNN metrics (`per_query[name][i]` belongs to query `queries[i]`, a manifest
    path)."""

    metrics: dict[str, float]
    queries: list[str]
    per_query: dict[str, np.ndarray]


@dataclass(frozen=True)
class Comparison:
    """The challenger against champion v`champion_version` on `split`: mean(challenger - champion) of the
    per-query `metric` over `queries` shared queries, its paired-bootstrap percentile interval [low, high],
    and both models' metrics on the split."""

    split: str
    metric: str
    champion_version: int
    difference: float
    low: float
    high: float
    confidence: float
    resamples: int
    seed: int
    queries: int
    challenger: dict[str, float]
    champion: dict[str, float]
    # The bootstrap's resampled means (this register's own comparison only; not recorded): the gate's figure.
    means: np.ndarray | None = field(default=None, compare=False, repr=False)

    def interval(self) -> str:
        """`recall@1 on val +0.0120 [-0.0040, +0.0290] (95% paired bootstrap, 1000 resamples, 420 queries)`"""
        return (f"{self.metric} on {self.split} {_signed(self.difference)} [{_signed(self.low)}, "
                f"{_signed(self.high)}] ({self.confidence * 100:g}% paired bootstrap, {self.resamples} "
                f"resamples, {self.queries} queries)")

    def short(self) -> str:
        """`+0.0120 [-0.0040, +0.0290] vs v2`: the difference and its interval, for a narrow table cell."""
        return (f"{_signed(self.difference)} [{_signed(self.low)}, {_signed(self.high)}] vs "
                f"v{self.champion_version}")

    def as_dict(self) -> dict[str, Any]:
        return {"split": self.split, "metric": self.metric, "champion_version": self.champion_version,
                "difference": self.difference, "low": self.low, "high": self.high,
                "confidence": self.confidence, "resamples": self.resamples, "seed": self.seed,
                "queries": self.queries, "challenger_metrics": self.challenger,
                "champion_metrics": self.champion}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Comparison:
        """The inverse of `as_dict` (a comparison recorded with a registered version)."""
        fields = {k: data[k] for k in ("split", "metric", "champion_version", "difference", "low", "high",
                                       "confidence", "resamples", "seed", "queries")}
        return cls(**fields, challenger=dict(data["challenger_metrics"]),
                   champion=dict(data["champion_metrics"]))


@dataclass(frozen=True)
class Decision:
    promote: bool
    decision: str  # promoted | rejected | held
    reason: str
    comparison: Comparison | None = None


def compare(challenger: SplitScores, champion: SplitScores, champion_version: int, cfg: RegistryConfig,
            split: str | None = None) -> Comparison:
    """Pair the two models' per-query values of `cfg.primary_metric` by query and bootstrap the difference.

    Both were scored on the same manifest rows; a query one of them could not embed (an image unreadable in
    one pass only) is left out of the pair."""
    metric = cfg.primary_metric
    position = {q: i for i, q in enumerate(champion.queries)}
    shared = [(i, position[q]) for i, q in enumerate(challenger.queries) if q in position]
    if len(shared) != len(challenger.queries) or len(shared) != len(champion.queries):
        log.warning("gate: %d of %d / %d queries scored by both models; comparing those", len(shared),
                    len(challenger.queries), len(champion.queries))
    if not shared:
        raise ValueError(f"no query of the {split or cfg.gate_split} split was scored by both models")
    mine, theirs = (np.asarray(index) for index in zip(*shared))
    diff, means = bootstrap_means(challenger.per_query[metric][mine], champion.per_query[metric][theirs],
                                  resamples=cfg.bootstrap_resamples, seed=cfg.bootstrap_seed)
    difference, low, high = percentile_interval(diff, means, cfg.confidence)
    return Comparison(split=split or cfg.gate_split, metric=metric, champion_version=int(champion_version),
                      difference=difference, low=low, high=high, confidence=cfg.confidence,
                      resamples=cfg.bootstrap_resamples, seed=cfg.bootstrap_seed, queries=len(shared),
                      challenger=dict(challenger.metrics), champion=dict(champion.metrics), means=means)


def decide(comparison: Comparison, cfg: RegistryConfig) -> Decision:
    """The rule of the module docstring, given the comparison with the champion. Pure."""
    c = comparison
    versus = f"champion v{c.champion_version}"
    failures = []
    if not c.low > cfg.min_improvement:
        if c.high < 0:
            why = "the challenger is worse (the whole interval is below 0)"
        elif c.low <= 0:
            why = "the interval contains 0: the difference is within noise"
        else:
            why = f"the lower bound {_signed(c.low)} does not exceed the required improvement"
        failures.append(f"{why}; promotion needs the interval's lower bound above "
                        f"{_signed(cfg.min_improvement)} (registry.min_improvement)")
    for name in cfg.guarded_metrics:
        theirs, mine = c.champion.get(name), c.challenger.get(name)
        if theirs is None or not np.isfinite(theirs):
            continue  # nothing to guard against
        if mine is None or not np.isfinite(mine):
            failures.append(f"{name} was not measured on {c.split} (champion has {theirs:.4f})")
        elif theirs - mine > cfg.tolerance + _EPS:
            failures.append(f"{name} on {c.split} fell by {theirs - mine:.4f} ({theirs:.4f} -> {mine:.4f}), "
                            f"more than the tolerance {cfg.tolerance:g}")
    if failures:
        return Decision(False, "rejected", f"{c.interval()} vs {versus}: " + "; ".join(failures), c)
    return Decision(True, "promoted", (
        f"{c.interval()} over {versus}: the lower bound exceeds {_signed(cfg.min_improvement)}; no guarded "
        f"metric fell by more than {cfg.tolerance:g} on {c.split}"), c)


def gate_settings(cfg: RegistryConfig) -> dict[str, Any]:
    """What decided a promotion besides the data: recorded with every version, shown on its card and in review
    (anyone who may start a run can override registry.*; the version says which gate it passed)."""
    return {"split": cfg.gate_split, "primary_metric": cfg.primary_metric,
            "min_improvement": cfg.min_improvement, "confidence": cfg.confidence, "tolerance": cfg.tolerance,
            "guarded_metrics": list(cfg.guarded_metrics), "bootstrap_resamples": cfg.bootstrap_resamples}


def settings_line(settings: Mapping[str, Any] | None) -> str:
    if not settings:
        return "not recorded (registered before xbn recorded them)"
    s = settings
    return (f"{s['primary_metric']} on {s['split']}, lower bound of the {s['confidence'] * 100:g}% interval above "
            f"{s['min_improvement']:+g}; guarded {', '.join(s['guarded_metrics']) or 'none'} within "
            f"{s['tolerance']:g}; {s['bootstrap_resamples']} resamples")


FIRST_MODEL = Decision(True, "promoted", "first registered model: there is no champion to compare with")


class Gate:
    """The gate for one challenger checkpoint: scores it on the gate split once, then judges it against
    whichever champion the registry holds when the decision is taken (cached per champion version, so the slow
    embedding can run before the registry lock and is redone inside it only if the champion changed)."""

    def __init__(self, params: Params, checkpoint: str | Path) -> None:
        self.params, self.checkpoint = params, Path(checkpoint)
        self._challenger: SplitScores | None = None
        self._decisions: dict[tuple[int, str], Decision] = {}

    def decide(self, champion: ModelVersionInfo | None, registry: Registry) -> Decision:
        if champion is None:
            return FIRST_MODEL
        key = (champion.version, champion.tags.get(SHA_TAG, ""))
        if key not in self._decisions:
            self._decisions[key] = self._judge(champion, registry)
        return self._decisions[key]

    def _judge(self, champion: ModelVersionInfo, registry: Registry) -> Decision:
        params, split = self.params, self.params.registry.gate_split

        if not (read_manifest(params.data.manifest)["split"] == split).any():
            return Decision(False, "held", (
                f"the manifest {params.data.manifest} has no '{split}' rows, so the challenger cannot be "
                f"compared with champion v{champion.version} on held-out data: registered, not promoted "
                f"automatically; set data.val_classes > 0 and rerun `xbn prepare` (or `dvc repro`), or "
                f"review it and promote it by hand (`xbn registry promote`)"))
        if self._challenger is None:
            self._challenger = score(params, self.checkpoint)
        with tempfile.TemporaryDirectory(prefix="xbn-champion-") as tmp:
            try:
                registered = registry.checkpoint(champion, tmp)
            except IntegrityError as exc:
                return Decision(False, "held", (
                    f"champion v{champion.version} cannot be compared: {exc}; not promoted automatically, "
                    f"review the registry and promote by hand (`xbn registry promote`)"))
            theirs = score(params, registered.path, image_size=registered.image_size)
        try:
            comparison = compare(self._challenger, theirs, champion.version, params.registry)
        except ValueError as exc:  # e.g. every val class has a single image: no query has a match
            return Decision(False, "held", f"{exc}: not promoted automatically over champion "
                                           f"v{champion.version}")
        return decide(comparison, params.registry)


def score(params: Params, checkpoint: str | Path, image_size: int | None = None) -> SplitScores:
    """Embed `registry.gate_split` of the manifest with the embedder at `checkpoint` (at `image_size`, default
    `data.image_size`, normalised as the checkpoint records) and score it, per query too."""
    # Imported here, not with the module: the registry's own steps (repair, plan, review) import this module on
    # every scheduled run, and these bring torch and timm (seconds in a fresh process).
    from xbn.evaluation.embed import embed_protocol
    from xbn.evaluation.engine import engined
    from xbn.evaluation.inference import choose_inference_mode
    from xbn.evaluation.metrics import retrieval_metrics
    from xbn.evaluation.served import model_engine
    from xbn.models import load_embedder
    from xbn.utils.runtime import resolve_device

    cfg = params.registry
    device = resolve_device(params.train.device)
    model, data_config, _ = load_embedder(checkpoint, map_location=device)
    size = image_size or params.data.image_size
    mode = choose_inference_mode(model, device, size, params.inference.precision, params.inference.channels_last)
    engine = model_engine(model, data_config, size, file_digest(checkpoint), device, params.inference.engine)
    embedded = embed_protocol(
        engined(model, engine), read_manifest(params.data.manifest), params.data.root, cfg.gate_split,
        image_size=size, mean=data_config["mean"], std=data_config["std"],
        batch_size=params.eval.batch_size, num_workers=params.data.num_workers, device=device,
        mode=mode)
    metrics, per_query = retrieval_metrics(
        embedded.query_emb, embedded.query_labels, embedded.reference_emb, embedded.reference_labels,
        ks=_ks(params), chunk_size=params.eval.query_chunk, device=str(device),
        nmi="nmi" in cfg.guarded_metrics, seed=params.train.seed, per_query=True)
    queries = [q for q, kept in zip(embedded.query_paths, per_query.evaluated) if kept]
    values = {k: int(v) if isinstance(v, (int, np.integer)) else float(v) for k, v in metrics.items()}
    return SplitScores(values, queries, per_query.scores)


def report_metrics(metrics: Mapping[str, float], cfg: RegistryConfig) -> dict[str, float]:
    """The metrics worth showing from a gate split's scores: the quality ones, primary and guarded first."""
    head = [cfg.primary_metric, *cfg.guarded_metrics]
    rest = sorted(k for k in metrics if k not in head and not k.startswith(("num_", "queries_")))
    return {k: metrics[k] for k in [*dict.fromkeys(head), *rest] if k in metrics}


def _ks(params: Params) -> tuple[int, ...]:
    cfg = params.registry
    named = [int(m.removeprefix("recall@")) for m in (cfg.primary_metric, *cfg.guarded_metrics)
             if m.startswith("recall@")]
    return tuple(sorted({*params.eval.k, *named}))


def _signed(value: float) -> str:
    return f"{value + 0.0:+.4f}"  # + 0.0 turns -0.0 into 0.0


def make_champion(registry: Registry, version: int, champion: ModelVersionInfo | None, *, by: str, action: str,
                  reason: str) -> None:
    """Move `champion` to `version` (under the caller's registry lock): the move is appended to the champion's
    history first (`xbn.tracking.history`, what rollback walks), then the alias moves; the version also records
    the champion it replaced (tag `previous_champion`, for a reviewer; never read to decide). A challenger that
    becomes champion loses the `challenger` alias."""
    before = champion.version if champion is not None else None
    history = read_history(registry)
    last = history[-1] if history else None
    # The same move already logged and the alias not moved: a registration stopped between the two. Not twice.
    if last is None or (last.action, last.from_version, last.to_version) != (action, before, version):
        append_history(registry, by=by, action=action, from_version=before, to_version=version, reason=reason,
                       history=history)
        fault_point("promotion.after_history")
    if before is not None and before != version:
        registry.set_tags(version, {"previous_champion": before})
    registry.set_alias(CHAMPION, version)
    challenger = registry.by_alias(CHALLENGER)
    if challenger is not None and challenger.version == version:  # it is no longer a challenger
        registry.remove_alias(CHALLENGER)


def finish_logged_move(registry: Registry, history: list[ChampionChange] | None = None) -> ChampionChange | None:
    """The champion history's last move, when it was logged but the alias never followed (a process killed
    between the two writes: `promotion.after_history`): the alias moves now, as logged. Returns that entry, or
    None when the alias is where the log says. The caller holds the registry lock."""
    history = read_history(registry) if history is None else history
    champion = registry.by_alias(CHAMPION)
    last = history[-1] if history else None
    if last is None or champion is None or last.from_version != champion.version or last.to_version == \
            champion.version:
        return None
    log.warning("%s: history #%d (%s v%s -> v%s) was logged but the champion alias never moved: moving it now",
                registry.name, last.seq, last.action, last.from_version, last.to_version)
    registry.set_alias(CHAMPION, last.to_version)
    return last


def rollback_target(history: list[ChampionChange], champion: int | None, model_name: str) -> ChampionChange:
    """The history entry a rollback reverts: the last move to a champion that no later rollback undid. Its
    `from_version` is what the rollback restores, so v1 stays reachable after v2 -> v3 -> rollback -> rollback
    whatever order concurrent promotions took. Raises `RegistryError` (exit 1) when there is nothing to restore,
    or when the alias was moved outside xbn (the log's last champion is not the current one)."""
    undone = {e.undoes for e in history if e.action == "rollback"}
    live = [e for e in history if e.action != "rollback" and e.seq not in undone]
    if champion is None:
        raise RegistryError(f"{model_name} has no champion to roll back")
    if not live:
        raise RegistryError(f"nothing to roll back to: the champion history of {model_name} records no promotion "
                            f"still in effect (champion v{champion}); promote a version by hand with "
                            f"`xbn registry promote --model-version N --reason ...`")
    last = live[-1]
    if last.to_version != champion:
        raise RegistryError(f"the champion alias of {model_name} points at v{champion} but its history's last "
                            f"promotion made v{last.to_version} champion (#{last.seq}): it was moved outside xbn; "
                            f"promote the intended version by hand (`xbn registry promote`)")
    if last.from_version is None:
        raise RegistryError(f"nothing to roll back to: v{champion} is the first champion of {model_name} "
                            f"(history #{last.seq}); promote another version by hand with "
                            f"`xbn registry promote --model-version N --reason ...`")
    return last
