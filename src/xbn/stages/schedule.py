"""What a scheduled retraining should do this time, decided before any training (issue 24).

`plan` compares the data snapshot (`xbn.data.snapshot`: DVC's md5 of the images, the manifest's md5) and the
params the schedule asked for with what the champion recorded (version tags `data_md5`, `data_hash`,
`request_hash`):
- nothing changed: nothing is retrained (unless forced), and the run says since which version;
- something changed: fine-tune the champion (`train.init: champion`), with a drift report of the current data
  against the champion's; or train from pretrained weights when there is no champion, when the params ask for a
  model the champion's weights do not fit, or when the drift is significant and `drift.retrain_from_pretrained`
  says so. The decision and its reason are recorded (flow summary, run tags `xbn.plan*`).
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from xbn.config import ConfigError, Params
from xbn.data.snapshot import DATA_FILES, DataSnapshot, snapshot
from xbn.stages.drift import drift_report
from xbn.stages.promotion import CHAMPION
from xbn.tracking import Registry, params_hash
from xbn.utils.errors import ServiceUnavailableError

log = logging.getLogger(__name__)

REQUEST_TAG = "request_hash"  # the params the schedule asked for, before it chose train.init and tuned


@dataclass(frozen=True)
class Plan:
    retrain: bool
    init: str  # pretrained | champion: where the weights start, when retraining
    reason: str  # one line for people: what changed, or since when nothing did
    champion: int | None
    request_hash: str
    drift: dict[str, Any] | None = field(default=None, compare=False)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def request_hash(params: Params) -> str:
    """The params as requested, hashed as every params hash is (`params_hash`): before the flow chooses
    train.init or tunes, so that it compares with the champion's `params_hash` for a version without the tag."""
    return params_hash(params)


def plan(params: Params, data: DataSnapshot, force: bool = False) -> Plan:
    """Decide for `params` (as requested, before train.init is chosen) and the data snapshot just taken."""
    requested = request_hash(params)
    registry = Registry(params)
    champion = registry.by_alias(CHAMPION)
    if champion is None:
        return Plan(True, "pretrained", f"no champion in {params.registry.model_name} yet: training from "
                                        "pretrained weights", None, requested)
    v = champion.version
    changed = changes(champion.tags, data, requested)
    if not changed and not force:
        return Plan(False, "champion", f"no change since v{v} (data {_short(data.md5)}, params "
                                       f"{_short(requested)}): nothing retrained", v, requested)
    reason = "; ".join(changed) or "nothing changed, but the run was forced"
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = registry.checkpoint(champion, Path(tmp) / "champion").path
        try:
            from xbn.models import InitialWeights

            InitialWeights(checkpoint, "champion", "", v).check(params.model)
        except ConfigError as exc:
            return Plan(True, "pretrained", f"{reason}; the champion's weights do not fit ({exc}): training from "
                                            "pretrained weights", v, requested)
        drift = _drift(params, registry, champion, checkpoint, Path(tmp))
    init = "champion"
    if drift and drift["significant"] and params.drift.retrain_from_pretrained:
        init = "pretrained"
        reason += f"; significant drift (p = {drift['embedding']['p_value']:.3f} < {params.drift.alpha:g}): " \
                  "training from pretrained weights (drift.retrain_from_pretrained)"
    else:
        reason += f": fine-tuning champion v{v}"
    return Plan(True, init, reason, v, requested, drift)


def changes(tags: dict[str, str], data: DataSnapshot, requested: str) -> list[str]:
    """What differs from the champion (its version `tags`): the data, the requested params; [] for nothing."""
    found = []
    if data.md5 is None:
        found.append("data not versioned (data.version: none): whether the images changed is unknown")
    elif tags.get("data_md5") != data.md5 or tags.get("data_hash") != data.manifest_md5:
        found.append(f"data changed (DVC md5 {_short(tags.get('data_md5'))} -> {_short(data.md5)})")
    if tags.get(REQUEST_TAG, tags.get("params_hash")) != requested:
        found.append("params changed")
    return found


def unchanged_since_champion(params: Params) -> str | None:
    """`xbn run`'s check before training: a DVC snapshot of the data (recorded, so that the version this run
    registers carries its `data_md5`), then the reason line when the data and the params equal the champion's,
    else None. Where the data cannot be versioned (no DVC project, no remote, data.version: none) whether it
    changed is unknown: None, with a line saying so."""
    if not params.tracking.enabled or params.data.version == "none":
        return None
    try:
        data = snapshot(params)
    except (ConfigError, ServiceUnavailableError) as exc:
        log.info("data not versioned, so every run trains: %s", exc)
        return None
    champion = Registry(params).by_alias(CHAMPION)
    if champion is None or changes(champion.tags, data, request_hash(params)):
        return None
    return f"no change since v{champion.version} (data {_short(data.md5)}, params {_short(request_hash(params))})" \
           ": nothing retrained"


def _drift(params: Params, registry, champion, checkpoint: Path, tmp: Path) -> dict[str, Any] | None:
    recorded = registry.data_snapshot(champion.run_id, tmp / "data")
    if recorded is None:
        log.warning("champion v%d recorded no data snapshot: no drift report", champion.version)
        return None
    now = pd.read_parquet(DATA_FILES)
    return drift_report(params, checkpoint, champion.version, recorded[1], now,
                        profile_before=_profile(registry, champion.run_id, tmp),
                        profile_after=_read_profile(Path(params.validate.report)))


def _profile(registry, run_id: str | None, tmp: Path) -> dict | None:
    path = registry.run_artifact(run_id, "validation/validation.json", tmp / "validation")
    return _read_profile(path) if path else None


def _read_profile(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()).get("summary", {}).get("profile")
    except (OSError, ValueError):
        return None


def _short(value: str | None) -> str:
    return (value or "none")[:12]


__all__ = ["REQUEST_TAG", "Plan", "changes", "plan", "request_hash", "unchanged_since_champion"]
