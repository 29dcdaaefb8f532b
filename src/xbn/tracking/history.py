"""The champion's history: an append-only log of every move of the `champion` alias, kept in the MLflow registry
itself (one registered-model tag per entry), so it survives with the tracking store alone.

Each entry is the tag `champion_history.<seq>.<token>` (seq zero-padded, so the MLflow UI lists them in order;
the token is the writer's own, so no write can overwrite another's; older stores have `champion_history.<seq>`)
holding JSON: `seq`, `at` (UTC), `by`, `action` (`gate`: the promotion gate; `promote`: by hand; `rollback`),
`from_version` (the champion it replaced; null for the first), `to_version`, `reason`, and for a rollback
`undoes` (the seq of the entry it reverted). Entries are only ever added, under the registry lock
(`Registry.lock`) that the alias moves hold, so each entry's `from_version` is the champion the previous entry
left. Should two writers still meet (a lock lost with its connection), the append reads its seq back after
writing: a writer that finds another entry at its seq withdraws its own and appends again, so of two writers at
most one keeps a seq (each writes before it reads) and neither entry is lost. What a rollback restores is
decided from this log (`xbn.stages.promotion.rollback_target`), never from per-version pointers, which
concurrent promotions could turn into a cycle.
"""

from __future__ import annotations

import json
import logging
import random
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode

from xbn.tracking.registry import Registry
from xbn.utils.errors import RegistryError
from xbn.utils.faults import fault_point

log = logging.getLogger(__name__)

HISTORY_TAG_PREFIX = "champion_history."
_SEQ_DIGITS = 6
# MLflow caps a registered-model tag's value at 5000 characters; the reason is what can be long.
_MAX_REASON = 2000
_APPEND_TRIES = 5


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
    return [entry for _, entry in _entries(registry)]


def _entries(registry: Registry) -> list[tuple[str, ChampionChange]]:
    """(tag key, entry), ordered by seq, then key (two at one seq: a writer killed before it withdrew)."""
    try:
        tags = registry.client.get_registered_model(registry.name).tags or {}
    except MlflowException as exc:
        if exc.error_code == ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            return []
        raise
    entries = [(key, ChampionChange(**json.loads(value))) for key, value in tags.items()
               if key.startswith(HISTORY_TAG_PREFIX)]
    return sorted(entries, key=lambda item: (item[1].seq, item[0]))


def append_history(registry: Registry, *, by: str, action: str, from_version: int | None, to_version: int,
                   reason: str, undoes: int | None = None,
                   history: list[ChampionChange] | None = None) -> ChampionChange:
    """Add one entry after the last. The caller holds `registry.lock()`: the next seq is read, then written
    (`history`: the log as the caller just read it, not read again), then read back (see the module's text)."""
    token = uuid.uuid4().hex[:8]
    for attempt in range(_APPEND_TRIES):
        if history is None or attempt:
            history = read_history(registry)
        entry = ChampionChange(
            seq=(history[-1].seq + 1) if history else 1,
            at=datetime.now(UTC).isoformat(timespec="seconds"), by=by, action=action,
            from_version=from_version, to_version=int(to_version), reason=reason[:_MAX_REASON], undoes=undoes)
        key = f"{HISTORY_TAG_PREFIX}{entry.seq:0{_SEQ_DIGITS}d}.{token}"
        fault_point("history.before_write")
        registry.check_lock()
        registry.client.set_registered_model_tag(registry.name, key, json.dumps(asdict(entry), sort_keys=True))
        if not any(other.seq == entry.seq and k != key for k, other in _entries(registry)):
            return entry
        log.warning("champion history: another writer took #%d of %s too; appending again", entry.seq,
                    registry.name)
        registry.client.delete_registered_model_tag(registry.name, key)
        time.sleep(random.uniform(0.05, 0.5) * (attempt + 1))  # two that met twice do not meet a third time
    raise RegistryError(f"the champion history of {registry.name}: {_APPEND_TRIES} appends met another writer's "
                        "at the same place; is a writer running without the shared lock (tracking.lock_uri)?")
