"""The MLflow model registry for one registered model: versions, aliases, tags, descriptions.

A thin service over `MlflowClient`: what to register and when to promote is decided by `xbn.stages.register`;
this module only reads and writes the registry and hands back plain `ModelVersionInfo` records.

Where a version's record lives. The version tags are the few a reviewer scans across versions in the MLflow
UI's versions table (`xbn.stages.register` chooses them). What is read rather than scanned is recorded on the
version's logged model (`models:/m-...`, MLflow 3), written by `Registry.record` before the version exists:
the reported metrics as the model's metrics on the evaluated dataset (also in the run), and the promotion
gate's comparison as the model's tag `gate`. Versions registered before this layout carry both as version
tags (`metric.<key>`, `gate`); they are still read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import mlflow
import mlflow.artifacts
import mlflow.models
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode
from mlflow.tracking import MlflowClient

from xbn.config import Params
from xbn.data.snapshot import DATA_FILES, DATA_RECORD
from xbn.tracking.fingerprints import file_digest
from xbn.tracking.locks import DEFAULT_TIMEOUT_S, held_run_locks, registry_lock
from xbn.tracking.pyfunc import CHECKPOINT_ARTIFACT, SHA_TAG
from xbn.tracking.runs import DATA_ARTIFACTS, PipelineRun, configure, metric_key, metric_name
from xbn.tracking.services import wait_reachable
from xbn.utils.errors import IntegrityError
from xbn.utils.faults import fault_point
from xbn.utils.integrity import verify_file, verify_listed, write_sidecar
from xbn.utils.locks import Held
from xbn.utils.secrets import mask_secrets

METRIC_TAG_PREFIX = "metric."  # versions registered before: a version tag per metric (read, not written)
log = logging.getLogger(__name__)

GATE_TAG = "gate"  # the gate's comparison as JSON: a tag of the logged model (of the version, before)
GATE_SETTINGS_TAG = "gate_settings"  # the registry.* settings the gate judged with, as JSON (logged model)
_LOGGED_MODEL = re.compile(r"models:/(m-[0-9a-f]+)")
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
    # The reported metrics recorded at registration, under their own names (`recall@1`).
    metrics: dict[str, float] = field(default_factory=dict)
    gate: dict[str, Any] | None = None  # the promotion gate's comparison at registration (None: not compared)
    # The gate's settings that judged it (registry.confidence, tolerance, guarded_metrics...); None: before xbn
    # recorded them. A run's overrides can change them, so the version says which gate it passed.
    gate_settings: dict[str, Any] | None = None


SERVED_TAG = "served_embedding"  # plain | refined (seed 001's context refiner on top of the embedder)
PARENT_TAG = "parent_version"  # the version a fine-tuned model started from (train.init: champion)
# SHA_TAG (from pyfunc, which checks it on load): the checkpoint's sha256, kept in the tracking store with the
# version.
# What serves the version, logged on its logged model after registration (stage `index`, `xbn export`): the
# catalogue index folder under `index/<sha256>/` and the ONNX file under `onnx/<sha256>/`. Their sha256 go to
# version tags, kept in the tracking store like SHA_TAG, so a download is checked against a record the artifact
# store cannot alter; content-addressed, so an upload killed before its tag moved leaves the tagged files intact.
INDEX_ARTIFACT, ONNX_ARTIFACT = "index", "onnx"
INDEX_SHA_TAG = "index_sha256"  # of the folder's index.json, which names the sha256 of the other files
INDEX_META = "index.json"
INDEX_RECALL_TAG = "index_recall_at_10"  # the index's recall@10 against exact search
# `xbn catalogue`'s record: "<sha256 of the catalogue's rows>:<index_sha256 of the index built from them>"
CATALOGUE_TAG = "catalogue_fingerprint"
ONNX_SHA_TAG = "onnx_sha256"
# The same graph as an MLflow `onnx` model (`runs:/<run>/onnx_model`, the version's run): loadable by
# mlflow.onnx.load_model and onnxruntime without xbn.
ONNX_MODEL_ARTIFACT, ONNX_MODEL_TAG = "onnx_model", "onnx_model_uri"


def _trained_image_size(checkpoint: Path) -> int | None:
    """The image size in the params a checkpoint records (None: written before xbn recorded them)."""
    import torch

    saved = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
    size = ((saved.get("params") or {}).get("data") or {}).get("image_size")
    return int(size) if size else None


@dataclass(frozen=True)
class RegisteredCheckpoint:
    """A registered version's embedder checkpoint on local disk (sha256 verified) and the image size the
    version serves at (its pyfunc's metadata; None if it records none)."""

    path: Path
    image_size: int | None


def log_refiner(run: PipelineRun, path: str) -> None:
    """Log the context refiner (`refine.output`) as an artifact of the run, under `refiner/`."""
    MlflowClient(run.tracking_uri).log_artifact(run.run_id, str(path), "refiner")


# What a lost answer looks like to MLflow's REST client (no answer at all: INTERNAL_ERROR "API request ... failed
# with exception"; a proxy's 502/503/504), as opposed to the server's own refusal of the request.
_LOST_ANSWER = ("INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "BAD_GATEWAY", "SERVICE_UNDER_MAINTENANCE")


@contextlib.contextmanager
def _requests_sent_once():
    """MLflow's REST client without its retries (read per request from MLFLOW_HTTP_REQUEST_MAX_RETRIES)."""
    import os

    saved = os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES")
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("MLFLOW_HTTP_REQUEST_MAX_RETRIES", None)
        else:
            os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = saved


class Registry:
    """The versions of registered model `params.registry.model_name` in the tracking store of `params`."""

    def __init__(self, params: Params) -> None:
        self.uri = configure(params)
        self.client = MlflowClient(self.uri)
        self.name = params.registry.model_name
        self.lock_uri = params.tracking.lock_uri
        self.outage_s = params.tracking.outage_s
        self._held: Held | None = None  # the registry lock, while `lock()` holds it

    @contextlib.contextmanager
    def lock(self, timeout: float = DEFAULT_TIMEOUT_S):
        """Serialise a read-decide-move-alias step with every other process promoting this model in this
        store (see `xbn.tracking.locks`); without it two runs could both see no champion and both win. Every
        write inside the block first checks that the lock is still held (`LockLost` otherwise)."""
        with registry_lock(self.uri, self.name, timeout, self.lock_uri) as held:
            self._held = held
            try:
                yield held
            finally:
                self._held = None

    def check_lock(self) -> None:
        """Raise `LockLost` if the registry lock this object holds (inside `lock()`), or the run lock this process
        holds (`xbn.tracking.locks.run_lock`), is gone: a run whose lock died with its database connection, and
        could not be taken back, stops before it writes."""
        for held in (*held_run_locks(), *([self._held] if self._held is not None else [])):
            held.check()

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
        """The first version whose tag `key` equals `value` (tag values here are hex digests: no quoting). The
        first: a later one with the same model sha256 is a duplicate of a retried create request."""
        found = self.client.search_model_versions(
            f"name = '{self.name}' and tags.{key} = '{value}'", max_results=1,
            order_by=["version_number ASC"],
        )
        # Search results leave the aliases out: read the version itself.
        return self.get(found[0].version) if found else None

    def record(self, model_uri: str, run_id: str, metrics: Mapping[str, float], dataset: str, digest: str,
               prefix: str = "", gate: Mapping[str, Any] | None = None,
               settings: Mapping[str, Any] | None = None) -> None:
        """Record on the logged model `model_uri`, before it is registered, what its version reports but a
        reviewer does not scan across versions: `metrics` (own names, `recall@1`) as the model's metrics on
        dataset `dataset` with digest `digest` (MLflow logs them to run `run_id` too, as `prefix` + key:
        pass the prefix the evaluate stage logs them under, so the run's values stay what they were), and the
        gate's comparison `gate` as the model's tag `gate` (JSON), and the gate's `settings` as its tag
        `gate_settings` (JSON). Recording again adds later values, which win."""
        model_id = _model_id(model_uri)
        if model_id is None:
            raise ValueError(f"{model_uri} is not a logged model (models:/m-...)")
        now = int(time.time() * 1000)
        self.client.log_batch(run_id, metrics=[
            Metric(prefix + metric_key(k), float(v), now, 0, model_id=model_id, dataset_name=dataset,
                   dataset_digest=digest) for k, v in metrics.items()])
        tags = {GATE_TAG: gate, GATE_SETTINGS_TAG: settings}
        if written := {k: json.dumps(dict(v), sort_keys=True) for k, v in tags.items() if v is not None}:
            self.client.set_logged_model_tags(model_id, written)

    def create(self, model_uri: str, tags: Mapping[str, str]) -> ModelVersionInfo:
        """Register `model_uri` (a logged model) as the next version, with tags; at most once per model sha256
        (`tags[SHA_TAG]`). MLflow's client retries a POST whose response was lost, which registered the model
        twice; here the request is sent once, and if its answer is lost (a dropped connection, a 5xx) the model
        is looked up by its sha256 before it is asked for again."""
        self.check_lock()
        sha = tags.get(SHA_TAG)
        try:
            with _requests_sent_once() if sha else contextlib.nullcontext():
                version = mlflow.register_model(model_uri, self.name, tags=dict(tags))
        except MlflowException as exc:
            if not sha or exc.error_code not in _LOST_ANSWER:
                raise

            # MLflow's message holds the request's URL, with the tracking URI's credentials: masked.
            log.warning("%s: the answer to registering %s was lost (%s): looking it up before asking again",
                        self.name, model_uri, mask_secrets(str(exc))[:300])
            wait_reachable(self.uri, self.outage_s)
            if (found := self.find_by_tag(SHA_TAG, sha)) is not None:
                return found  # the server registered it: the answer only was lost
            self.check_lock()
            version = mlflow.register_model(model_uri, self.name, tags=dict(tags))
        return self.get(version.version)

    def set_description(self, version: int, text: str) -> None:
        self.check_lock()
        self.client.update_model_version(self.name, str(version), description=text)

    def set_alias(self, alias: str, version: int) -> None:
        self.check_lock()
        self.client.set_registered_model_alias(self.name, alias, str(version))

    def remove_alias(self, alias: str) -> None:
        """Remove `alias`; an account without MANAGE on the model (MLflow's auth app lets only MANAGE delete an
        alias, and the pipeline's account has EDIT) leaves it, with a warning: readers take a challenger on the
        champion's version for none (`challenger`)."""
        self.check_lock()
        if self.by_alias(alias) is not None:
            try:
                self.client.delete_registered_model_alias(self.name, alias)
            except MlflowException as exc:
                if exc.error_code != "PERMISSION_DENIED":
                    raise
                log.warning("%s: this account may not delete the alias %r (it needs MANAGE): left in place",
                            self.name, alias)

    def challenger(self, champion: ModelVersionInfo | None) -> ModelVersionInfo | None:
        """The `challenger` alias's version, unless it is the champion's (an alias left by an account that may
        not delete it): a champion is nobody's challenger."""
        found = self.by_alias("challenger")
        return None if found is None or (champion is not None and found.version == champion.version) else found

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
        write_sidecar(path)  # the verified bytes: every later load of this copy (`load_embedder`) checks them
        logged = (info.metadata or {}).get("image_size")  # the MLmodel's: the artifact store, not hashed
        trained = _trained_image_size(path)  # the verified checkpoint's own params
        if logged and trained and str(logged) != str(trained):
            raise IntegrityError(f"{self.name} v{version.version}: its MLmodel gives image_size {logged}, but "
                                 f"its verified checkpoint was trained at {trained}: the MLmodel was altered "
                                 "after registration")
        size = trained or logged
        return RegisteredCheckpoint(path, int(size) if size else None)

    def log_index(self, version: ModelVersionInfo, directory: str | Path, recall: float,
                  tags: Mapping[str, str] | None = None) -> None:
        """Attach the catalogue index folder `directory` (its `index.json` names the other files' sha256) to
        `version`, so that moving an alias to the version moves its index with it; a later call (an appended
        index, a re-embedded catalogue) replaces it. Each index is uploaded beside the others, under
        `index/<sha256 of its index.json>/`, and goes live when the tag naming that digest is set: one tag
        write, so a reader finds the previous index or the new one whole, never a mix. `tags`: more version
        tags, set after it (e.g. the catalogue's fingerprint)."""
        directory = Path(directory)
        digest = file_digest(directory / INDEX_META)
        self.client.log_model_artifacts(self._logged_model(version), str(directory), f"{INDEX_ARTIFACT}/{digest}")
        self.set_tags(version.version, {INDEX_SHA_TAG: digest, INDEX_RECALL_TAG: f"{recall:.4f}", **(tags or {})})

    def index_digest(self, version: ModelVersionInfo) -> str | None:
        """The sha256 of the index.json of the index attached to `version` (None: none attached)."""
        return version.tags.get(INDEX_SHA_TAG)

    def fetch_index(self, version: ModelVersionInfo, dst_dir: str | Path) -> Path:
        """Download `version`'s index folder into `dst_dir` and verify its `index.json` against the tag (the
        loader then checks the other files against `index.json`); what `RegistryModelSource` calls. Each
        index lands in its own folder (`index/<digest>`), so a newer one never overwrites files a running
        server has memory-mapped."""
        expected = version.tags.get(INDEX_SHA_TAG)
        if not expected:
            raise LookupError(f"{self.name} v{version.version} has no catalogue index: run `xbn index` with "
                              f"its model (models/model.pt of that version) to build and attach one")
        artifact = f"{INDEX_ARTIFACT}/{expected}"
        listed = self.client.list_logged_model_artifacts(self._logged_model(version), INDEX_ARTIFACT)
        if artifact not in {f.path for f in listed}:
            artifact = INDEX_ARTIFACT  # attached before indexes were kept by digest: the files are in index/
        path = Path(mlflow.artifacts.download_artifacts(
            artifact_uri=f"models:/{self.name}/{version.version}/{artifact}", dst_path=str(dst_dir),
            tracking_uri=self.uri))
        verify_file(path / INDEX_META, expected, what=f"the index of {self.name} v{version.version}")
        return path

    def index_problem(self, version: ModelVersionInfo) -> str | None:
        """Why `version` could not serve (None: it can), checked as a new server would load it: no index
        attached; its index folder missing, or any of its files not the one the tag and its index.json name;
        its checkpoint missing or failing its sha256. Downloads the whole index and the checkpoint: a champion
        is what a fresh server can load, so promote, rollback and the weekly repair all pay for it."""
        import json
        import tempfile

        from mlflow.exceptions import MlflowException

        if not version.tags.get(INDEX_SHA_TAG):
            return "has no index attached"
        with tempfile.TemporaryDirectory(prefix="xbn-index-check-") as tmp:
            try:
                folder = self.fetch_index(version, Path(tmp) / "index")
                verify_listed(folder, json.loads((folder / INDEX_META).read_text()).get("sha256", {}),
                              f"{INDEX_META} of {self.name} v{version.version}")
            except (MlflowException, OSError) as exc:  # absent from the artifact store
                return f"has lost its index ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
            except (IntegrityError, ValueError) as exc:
                return f"has an index that fails its sha256 ({exc})"
            try:
                self.checkpoint(version, Path(tmp) / "checkpoint")
            except (MlflowException, OSError) as exc:
                return f"has lost its checkpoint ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
            except (IntegrityError, ValueError) as exc:
                return f"has a checkpoint that fails its sha256 ({exc})"
        return None

    def run_artifact(self, run_id: str | None, path: str, dst_dir: str | Path) -> Path | None:
        """Download artifact `path` (a file or folder) of run `run_id` into `dst_dir`; None if it has none."""
        if not run_id:
            return None
        try:
            return Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=path,
                                                            dst_path=str(dst_dir), tracking_uri=self.uri))
        except (MlflowException, OSError):
            return None

    def data_snapshot(self, run_id: str | None, dst_dir: str | Path) -> tuple[dict, Any] | None:
        """The data snapshot a training run recorded (`log_data`): its JSON and its per-image table (a pandas
        DataFrame), downloaded into `dst_dir`; None for a run that recorded none (before xbn did, or untracked)."""
        import pandas as pd

        folder = self.run_artifact(run_id, DATA_ARTIFACTS, dst_dir)
        if folder is None or not (folder / DATA_RECORD.name).exists() or not (folder / DATA_FILES.name).exists():
            return None
        return json.loads((folder / DATA_RECORD.name).read_text()), pd.read_parquet(folder / DATA_FILES.name)

    def log_onnx(self, version: ModelVersionInfo, path: str | Path, *companions: str | Path,
                 mlflow_model: str | Path | None = None) -> None:
        """Attach the ONNX export of `version`'s embedder and its `companions` (the preprocessing rule) under
        `onnx/<sha256>/`, the ONNX file's sha256 as a version tag (the rule records it too); and `mlflow_model`,
        the same graph as an MLflow `onnx` model folder, in the version's run under `onnx_model/<sha256>`, its URI
        as the tag `onnx_model_uri`. The tags move last: until then the version serves its earlier graph."""
        digest = file_digest(path)
        for file in (*companions, path):
            self.client.log_model_artifact(self._logged_model(version), str(file), f"{ONNX_ARTIFACT}/{digest}")
        tags = {ONNX_SHA_TAG: digest}
        if mlflow_model is not None and version.run_id:
            self.client.log_artifacts(version.run_id, str(mlflow_model), f"{ONNX_MODEL_ARTIFACT}/{digest}")
            tags[ONNX_MODEL_TAG] = f"runs:/{version.run_id}/{ONNX_MODEL_ARTIFACT}/{digest}"
        fault_point("registry.onnx_before_tags")
        self.set_tags(version.version, tags)

    def fetch_onnx(self, version: ModelVersionInfo, dst_dir: str | Path) -> Path | None:
        """Download `version`'s ONNX graph (`log_onnx`, under `onnx/<sha256>/`) into `dst_dir` and verify it
        against the version's `onnx_sha256` tag, as `checkpoint` verifies the checkpoint; None when the version
        has none (never exported). What `inference.engine` runs a registered version's ONNX Runtime on."""
        expected = version.tags.get(ONNX_SHA_TAG)
        if not expected:
            return None
        model = self._logged_model(version)
        graphs = [f.path for f in self.client.list_logged_model_artifacts(model, f"{ONNX_ARTIFACT}/{expected}")
                  if f.path.endswith(".onnx")]
        if not graphs:  # exported before graphs were kept by digest: the one file directly under onnx/
            graphs = [f.path for f in self.client.list_logged_model_artifacts(model, ONNX_ARTIFACT)
                      if f.path.endswith(".onnx")]
        if len(graphs) != 1:
            raise IntegrityError(f"{self.name} v{version.version} records {ONNX_SHA_TAG} but has "
                                 f"{len(graphs)} .onnx files under {ONNX_ARTIFACT}/")
        path = Path(mlflow.artifacts.download_artifacts(
            artifact_uri=f"models:/{self.name}/{version.version}/{graphs[0]}", dst_path=str(dst_dir),
            tracking_uri=self.uri))
        verify_file(path, expected, what=f"the ONNX graph of {self.name} v{version.version}")
        return path

    def _logged_model(self, version: ModelVersionInfo) -> str:
        model_id = _model_id(version.source)
        if model_id is None:
            raise ValueError(f"{self.name} v{version.version} is not backed by a logged model "
                             f"({version.source}): no place to attach its files")
        return model_id

    def set_tags(self, version: int, tags: Mapping[str, Any]) -> None:
        self.check_lock()
        for key, value in tags.items():
            self.client.set_model_version_tag(self.name, str(version), key, str(value))

    def _info(self, mv) -> ModelVersionInfo:
        created = datetime.fromtimestamp(mv.creation_timestamp / 1000, tz=UTC)
        tags = dict(mv.tags or {})
        metrics, gate, settings = self._recorded(mv.model_id or _model_id(mv.source))
        if not metrics:  # registered before: one version tag per metric
            metrics = {metric_name(k[len(METRIC_TAG_PREFIX):]): float(v) for k, v in tags.items()
                       if k.startswith(METRIC_TAG_PREFIX)}
        if gate is None and tags.get(GATE_TAG):
            gate = json.loads(tags[GATE_TAG])
        return ModelVersionInfo(
            name=mv.name, version=int(mv.version), run_id=mv.run_id or None,
            created_at=created.isoformat(timespec="seconds"), source=mv.source,
            aliases=tuple(mv.aliases or ()), tags=tags, description=mv.description or "",
            metrics=metrics, gate=gate, gate_settings=settings,
        )

    def _recorded(self, model_id: str | None) -> tuple[dict[str, float], dict[str, Any] | None,
                                                        dict[str, Any] | None]:
        """What `record` wrote on logged model `model_id`: the metrics (the latest value of each) and the
        gate. Only metrics with a dataset count: MLflow also links the run's metrics of the moment to a model
        when it is logged (training curves, `eval/...` counts), without one."""
        if model_id is None:
            return {}, None, None
        try:
            model = self.client.get_logged_model(model_id)
        except MlflowException as exc:
            if exc.error_code == _NOT_FOUND:
                return {}, None, None
            raise
        metrics: dict[str, float] = {}
        for m in sorted(model.metrics or (), key=lambda m: (m.step, m.timestamp)):
            if m.dataset_name:
                metrics[metric_name(m.key.rsplit("/", 1)[-1])] = m.value  # less the prefix (`refined/`)
        tags = model.tags or {}
        gate, settings = (json.loads(tags[k]) if tags.get(k) else None for k in (GATE_TAG, GATE_SETTINGS_TAG))
        return metrics, gate, settings


def _model_id(uri: str | None) -> str | None:
    """`models:/m-<hex>` (a logged model) -> `m-<hex>`; any other URI -> None."""
    match = _LOGGED_MODEL.fullmatch(uri or "")
    return match.group(1) if match else None
