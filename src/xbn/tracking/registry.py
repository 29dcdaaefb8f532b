"""The MLflow model registry for one registered model: versions, aliases, tags, descriptions.

A thin service over `MlflowClient`: what to register and when to promote is decided by `xbn.stages.register`;
this module only reads and writes the registry and hands back plain `ModelVersionInfo` records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import mlflow
import mlflow.artifacts
import mlflow.models
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode
from mlflow.tracking import MlflowClient

from xbn.config import Params
from xbn.tracking.integrity import IntegrityError, verify_file
from xbn.tracking.locks import DEFAULT_TIMEOUT_S, registry_lock
from xbn.tracking.pyfunc import CHECKPOINT_ARTIFACT
from xbn.tracking.runs import PipelineRun, configure, metric_key, metric_name

METRIC_TAG_PREFIX = "metric."
_NOT_FOUND = ErrorCode.Name(RESOURCE_DOES_NOT_EXIST)


@dataclass(frozen=True)
class ModelVersionInfo:
    """One registered version: what the stage needs to decide and report, without MLflow types."""

    name: str
    version: int
    run_id: str | None
    created_at: str  # ISO 8601, UTC
    source: str
    aliases: tuple[str, ...] = ()
    tags: dict[str, str] = field(default_factory=dict)
    description: str = ""

    @property
    def metrics(self) -> dict[str, float]:
        """The metrics recorded as `metric.<key>` tags, under their own names (`recall@1`)."""
        return {metric_name(k[len(METRIC_TAG_PREFIX):]): float(v) for k, v in self.tags.items()
                if k.startswith(METRIC_TAG_PREFIX)}


SERVED_TAG = "served_embedding"  # plain | refined (seed 001's context refiner on top of the embedder)
SHA_TAG = "model_sha256"  # the checkpoint's sha256, recorded in the tracking store with the version


@dataclass(frozen=True)
class RegisteredCheckpoint:
    """A registered version's embedder checkpoint on local disk (sha256 verified) and the image size the
    version serves at (its pyfunc's metadata; None if it records none)."""

    path: Path
    image_size: int | None


def log_refiner(run: PipelineRun, path: str) -> None:
    """Log the context refiner (`refine.output`) as an artifact of the run, under `refiner/`."""
    MlflowClient(run.tracking_uri).log_artifact(run.run_id, str(path), "refiner")


def metric_tags(metrics: Mapping[str, float]) -> dict[str, str]:
    """`{"recall@1": 0.5}` -> `{"metric.recall_at_1": "0.5"}` (full float precision, so the gate is exact)."""
    return {METRIC_TAG_PREFIX + metric_key(k): repr(float(v)) for k, v in metrics.items()}


class Registry:
    """The versions of registered model `params.registry.model_name` in the tracking store of `params`."""

    def __init__(self, params: Params) -> None:
        self.uri = configure(params)
        self.client = MlflowClient(self.uri)
        self.name = params.registry.model_name

    def lock(self, timeout: float = DEFAULT_TIMEOUT_S):
        """Serialise a read-decide-move-alias step with every other process promoting this model in this
        store (see `xbn.tracking.locks`); without it two runs could both see no champion and both win."""
        return registry_lock(self.uri, self.name, timeout)

    def by_alias(self, alias: str) -> ModelVersionInfo | None:
        try:
            return self._info(self.client.get_model_version_by_alias(self.name, alias))
        except MlflowException as exc:
            # No such model: RESOURCE_DOES_NOT_EXIST; no such alias: the SQL store's INVALID_PARAMETER_VALUE.
            if exc.error_code in (_NOT_FOUND, "INVALID_PARAMETER_VALUE"):
                return None
            raise

    def get(self, version: int | str) -> ModelVersionInfo:
        try:
            number = int(version)
        except ValueError:
            raise ValueError(f"a model version is a number, got {version!r}") from None
        try:
            return self._info(self.client.get_model_version(self.name, str(number)))
        except MlflowException as exc:
            if exc.error_code == _NOT_FOUND:
                raise ValueError(f"{self.name} has no version {number}") from None
            raise

    def find_by_tag(self, key: str, value: str) -> ModelVersionInfo | None:
        """The newest version whose tag `key` equals `value` (tag values here are hex digests: no quoting)."""
        found = self.client.search_model_versions(
            f"name = '{self.name}' and tags.{key} = '{value}'", max_results=1,
            order_by=["version_number DESC"],
        )
        # Search results leave the aliases out: read the version itself.
        return self.get(found[0].version) if found else None

    def create(self, model_uri: str, tags: Mapping[str, str]) -> ModelVersionInfo:
        """Register `model_uri` (a logged model) as the next version, with tags."""
        version = mlflow.register_model(model_uri, self.name, tags=dict(tags))
        return self.get(version.version)

    def set_description(self, version: int, text: str) -> None:
        self.client.update_model_version(self.name, str(version), description=text)

    def set_alias(self, alias: str, version: int) -> None:
        self.client.set_registered_model_alias(self.name, alias, str(version))

    def remove_alias(self, alias: str) -> None:
        if self.by_alias(alias) is not None:
            self.client.delete_registered_model_alias(self.name, alias)

    def checkpoint(self, version: ModelVersionInfo, dst_dir: str | Path) -> RegisteredCheckpoint:
        """Download `version`'s embedder checkpoint (its pyfunc's `checkpoint` artifact) into `dst_dir` and
        verify it against the sha256 the version recorded in the tracking store (tag `model_sha256`) before
        anything loads it: the artifact store is what could have been altered, so its own copy of the hash
        (the pyfunc's config) is not trusted. Raises `IntegrityError` on a mismatch or a missing hash."""
        uri = f"models:/{self.name}/{version.version}"
        expected = version.tags.get(SHA_TAG)
        if not expected:
            raise IntegrityError(f"{self.name} v{version.version} records no {SHA_TAG}: its checkpoint "
                                 f"cannot be verified, so it is not loaded")
        info = mlflow.models.get_model_info(uri)
        flavor = info.flavors.get("python_function", {})
        relative = (flavor.get("artifacts") or {}).get(CHECKPOINT_ARTIFACT, {}).get("path")
        if not relative:
            raise ValueError(f"{self.name} v{version.version} is not an xbn embedder (no "
                             f"'{CHECKPOINT_ARTIFACT}' artifact in its MLmodel)")
        path = Path(mlflow.artifacts.download_artifacts(
            artifact_uri=f"{uri}/{relative}", dst_path=str(dst_dir), tracking_uri=self.uri))
        verify_file(path, expected, what=f"the checkpoint of {self.name} v{version.version}")
        size = (info.metadata or {}).get("image_size")
        return RegisteredCheckpoint(path, int(size) if size else None)

    def set_tags(self, version: int, tags: Mapping[str, Any]) -> None:
        for key, value in tags.items():
            self.client.set_model_version_tag(self.name, str(version), key, str(value))

    def _info(self, mv) -> ModelVersionInfo:
        created = datetime.fromtimestamp(mv.creation_timestamp / 1000, tz=timezone.utc)
        return ModelVersionInfo(
            name=mv.name, version=int(mv.version), run_id=mv.run_id or None,
            created_at=created.isoformat(timespec="seconds"), source=mv.source,
            aliases=tuple(mv.aliases or ()), tags=dict(mv.tags or {}), description=mv.description or "",
        )
