"""The champion's history: an append-only log of every move of the `champion` alias, kept in the MLflow registry
itself (one registered-model tag per entry), so it survives with the tracking store alone.

Each entry is the tag `champion_history.<seq>` (seq zero-padded, so the MLflow UI lists them in order) holding
JSON: `seq`, `at` (UTC), `by`, `action` (`gate`: the promotion gate; `promote`: by hand; `rollback`),
`from_version` (the champion it replaced; null for the first), `to_version`, `reason`, and for a rollback
`undoes` (the seq of the entry it reverted). Entries are only ever added, under the registry lock
(`Registry.lock`) that the alias moves hold, so sequence numbers never collide and each entry's
`from_version` is the champion the previous entry left. What a rollback restores is decided from this log
(`xbn.stages.promotion.rollback_target`), never from per-version pointers, which concurrent promotions could
turn into a cycle.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode

from xbn.tracking.registry import Registry

HISTORY_TAG_PREFIX = "champion_history."
_SEQ_DIGITS = 6
# MLflow caps a registered-model tag's value at 5000 characters; the reason is what can be long.
_MAX_REASON = 2000


@dataclass(frozen=True)
class ChampionChange:
    seq: int
    at: str  # ISO 8601, UTC
    by: str
    action: str  # gate | promote | rollback
    from_version: int | None
    to_version: int
    reason: str
    undoes: int | None = None  # a rollback: the seq of the entry it reverted

    def line(self) -> str:
        """`#3 2026-11-25T03:37:53+00:00 rollback v3 -> v2 by ops (undoes #2): latency regression`"""
        before = f"v{self.from_version}" if self.from_version is not None else "none"
        undoes = f" (undoes #{self.undoes})" if self.undoes is not None else ""
        return (f"#{self.seq} {self.at} {self.action} {before} -> v{self.to_version} by {self.by}{undoes}: "
                f"{self.reason}")


def read_history(registry: Registry) -> list[ChampionChange]:
    """The log of `registry`'s model, oldest first; empty when the model or its log does not exist yet."""
    try:
        tags = registry.client.get_registered_model(registry.name).tags or {}
    except MlflowException as exc:
        if exc.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            return []
        raise
    entries = [ChampionChange(**json.loads(value)) for key, value in tags.items()
               if key.startswith(HISTORY_TAG_PREFIX)]
    return sorted(entries, key=lambda e: e.seq)


def append_history(registry: Registry, *, by: str, action: str, from_version: int | None, to_version: int,
                   reason: str, undoes: int | None = None,
                   history: list[ChampionChange] | None = None) -> ChampionChange:
    """Add one entry after the last. The caller holds `registry.lock()`: the next seq is read, then written
    (`history`: the log as the caller just read it, not read again)."""
    history = read_history(registry) if history is None else history
    entry = ChampionChange(
        seq=(history[-1].seq + 1) if history else 1,
        at=datetime.now(UTC).isoformat(timespec="seconds"), by=by, action=action,
        from_version=from_version, to_version=int(to_version), reason=reason[:_MAX_REASON], undoes=undoes)
    registry.check_lock()
    registry.client.set_registered_model_tag(registry.name, f"{HISTORY_TAG_PREFIX}{entry.seq:0{_SEQ_DIGITS}d}",
                                             json.dumps(asdict(entry), sort_keys=True))
    return entry
