"""Stage `catalogue` (`xbn catalogue`, the Prefect flow `xbn-catalogue` of xbn/flows/catalogue.py): the whole
catalogue embedded with one registry version (the champion by default), indexed, and the index attached to that
version, so that serving the version serves the catalogue.

The flow maps `embed_shard` over a Dask cluster; the steps it composes live here, each callable alone:

1. `plan`: the catalogue (`catalogue.source`: a folder, a manifest-format CSV or a parquet of paths, local or
   an fsspec URL) read and cut into shards of `catalogue.shard_size` rows. Each shard's rows go to a file and
   its output is named by the model's sha256 and the shard's rows, so a shard the same model embedded before
   is found done: a re-run after a crash resumes, and a second run embeds nothing.
2. `embed_shard` (on a worker): the version's checkpoint loaded once per process (sha256-verified against the
   registry, `Registry.checkpoint`), the shard embedded by `xbn.serving.embed_job` chunk by chunk
   (`catalogue.chunk_size`: a worker killed mid-shard loses at most the chunk it was on), the shard's parquet
   renamed into place whole.
3. `publish`: the index built from the shard files, in a temp folder: in memory (`index.type`) when the vectors
   fit `catalogue.memory_budget_gb`, else faiss's on-disk IVF (`catalogue.ondisk_type`, merge_ondisk,
   `xbn.serving.shards`); renamed whole into `<output>/indexes/`, attached to the version (it goes live at a
   single tag write, `Registry.log_index`) with the catalogue's fingerprint, and linked as `<output>/index`
   (the link swapped atomically). Serving never sees a half-built index.

Files under `catalogue.output`, which every worker must see at the same path (a shared filesystem):
`embeddings/<model sha256[:16]>/shard-NNNNNN-<rows digest>.{rows,}.parquet`, `indexes/<catalogue>-<model>/`
and the link `index`. Shard files of earlier models are kept (a rollback re-uses them); delete their folder
to reclaim the space.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from xbn.config import ConfigError, Params
from xbn.data.errors import DatasetError
from xbn.serving.sources import is_remote, read_source, rows_digest
from xbn.utils.allocator import fix_malloc_thresholds
from xbn.utils.errors import IntegrityError, RegistryError
from xbn.utils.integrity import verify_listed
from xbn.utils.io import atomic_path, file_digest, write_json

log = logging.getLogger(__name__)

INDEX_LINK = "index"


@dataclass(frozen=True)
class Shard:
    """One Dask task's worth of the catalogue: rows `rows_file` (path, label; relative to `root`) -> `output`."""

    number: int
    rows: int
    rows_file: str
    output: str
    root: str


@dataclass
class CataloguePlan:
    version: int
    model_sha256: str
    fingerprint: str  # rows_digest of the whole catalogue
    rows: int
    output: str  # catalogue.output, absolute
    shards: list[Shard] = field(default_factory=list)
    up_to_date: bool = False  # the version already serves the index of exactly these rows

    def todo(self) -> list[Shard]:
        return [s for s in self.shards if not Path(s.output).exists()]


def _registry(params: Params):
    if not params.tracking.enabled:
        raise ConfigError("xbn catalogue attaches its index to a registry version: tracking.enabled must be true")
    from xbn.tracking import Registry

    return Registry(params)


def target_version(params: Params, version: int | None = None):
    """The registry version to embed with: `version`, else the one holding `serve.alias` (the champion)."""
    registry = _registry(params)
    if version is not None:
        try:
            return registry.get(version)
        except ValueError as exc:
            raise RegistryError(str(exc)) from None
    info = registry.by_alias(params.serve.alias)
    if info is None:
        raise RegistryError(f"{registry.name} has no version with alias '{params.serve.alias}': nothing to "
                            "embed the catalogue with (register and promote one, or pass --model-version)")
    return info


def check_source(params: Params) -> str:
    """catalogue.source, which must be set."""
    if params.catalogue.source is None:
        raise ConfigError("catalogue.source is not set: name a folder, a CSV or a parquet of image paths "
                          "(local or s3://...)")
    return params.catalogue.source


def plan(params: Params, version: int | None = None) -> CataloguePlan:
    """Read the catalogue, cut it into shards and write their row files (see the module docstring)."""
    from xbn.tracking.registry import CATALOGUE_TAG, INDEX_SHA_TAG, SHA_TAG

    cfg = params.catalogue
    source = check_source(params)
    info = target_version(params, version)
    sha = info.tags.get(SHA_TAG)
    if not sha:
        raise IntegrityError(f"{info.name} v{info.version} records no {SHA_TAG}: its checkpoint cannot be verified")
    frame, root = read_source(source, root=cfg.root)
    root = root if is_remote(root) else Path(root).absolute()  # workers start elsewhere
    if frame.empty:
        raise ConfigError(f"catalogue.source {cfg.source}: no images in it")
    fingerprint = rows_digest(frame)
    output = Path(cfg.output).absolute()
    folder = output / "embeddings" / sha[:16]
    folder.mkdir(parents=True, exist_ok=True)
    shards = []
    for number, start in enumerate(range(0, len(frame), cfg.shard_size)):
        rows = frame.iloc[start:start + cfg.shard_size].reset_index(drop=True)
        stem = f"shard-{number:06d}-{rows_digest(rows)[:12]}"
        rows_file = folder / f"{stem}.rows.parquet"
        if not rows_file.exists():  # named by its content: an existing one holds these rows
            with atomic_path(rows_file) as tmp:
                rows.to_parquet(tmp, index=False)
        shards.append(Shard(number, len(rows), str(rows_file), str(folder / f"{stem}.parquet"), str(root)))
    recorded = info.tags.get(CATALOGUE_TAG, "")
    # The tags say which index the version serves; the artifact store must still hold it (a lost index is rebuilt).
    up_to_date = (recorded == f"{fingerprint}:{info.tags.get(INDEX_SHA_TAG, '')}"
                  and _registry(params).index_problem(info) is None)
    result = CataloguePlan(info.version, sha, fingerprint, len(frame), str(output), shards, up_to_date)
    log.info("catalogue: %d image(s) in %d shard(s) of %d for %s v%d, %d to embed%s", len(frame), len(shards),
             cfg.shard_size, info.name, info.version, len(result.todo()),
             " (the version already serves this catalogue's index)" if up_to_date else "")
    return result


# The model each worker process embeds with, loaded once per (store, model, version): a Dask worker runs many
# shards, and its threads may start several at once.
_MODELS: dict[tuple[str, str, int], Any] = {}
_MODELS_LOCK = threading.Lock()


def worker_model(params: Params, version: int):
    """The checkpoint of registry version `version`, downloaded into a folder of this process's own (workers on
    one machine must not write the same files), sha256-verified against the registry, and loaded."""
    from xbn.stages.serve import model_source
    from xbn.tracking import tracking_uri

    key = (tracking_uri(params), params.registry.model_name, version)
    with _MODELS_LOCK:
        if key not in _MODELS:
            with tempfile.TemporaryDirectory(prefix="xbn-catalogue-model-") as where:
                source = model_source(params, version)
                source.cache_dir = Path(where)
                _MODELS[key] = source.load_model()[1]  # the weights are in memory: the folder can go
            log.info("catalogue: %s v%d loaded in process %d", params.registry.model_name, version, os.getpid())
        return _MODELS[key]


def embed_shard(params: Params, version: int, shard: Shard) -> dict[str, Any]:
    """Embed one shard into its parquet file (nothing when it exists). While it runs, `<output>.running`
    says which process has it (a killed worker's is overwritten by the next one's)."""
    import torch

    from xbn.serving.embed_job import embed_rows_to_parquet

    output = Path(shard.output)
    report = {"shard": shard.number, "rows": shard.rows, "embedded": False, "host": socket.gethostname(),
              "pid": os.getpid(), "started": time.time()}
    if output.exists():
        return {**report, "finished": report["started"]}
    # Dask workers start with OMP_NUM_THREADS=1; set before the model loads, whose ONNX Runtime session (if
    # `inference.engine` runs it) takes as many threads as torch has (`xbn.evaluation.engine.session`)
    torch.set_num_threads(params.catalogue.threads_per_worker)
    model = worker_model(params, version)
    fix_malloc_thresholds()  # and with a malloc trim threshold that made embedding 3x slower there
    running = output.with_name(f"{output.name}.running")
    write_json(running, {"pid": os.getpid(), "host": report["host"], "started": report["started"]})
    done = embed_rows_to_parquet(model, pd.read_parquet(shard.rows_file), shard.root, output,
                                 chunk_size=params.catalogue.chunk_size, batch_size=params.index.batch_size,
                                 num_workers=0, progress=False)  # daemonic Dask workers cannot fork loaders
    running.unlink(missing_ok=True)
    return {**report, "embedded": True, "finished": time.time(), "written": done.rows,
            "skipped": len(done.skipped), "chunks_resumed": done.chunks_resumed}


def publish(params: Params, catalogue: CataloguePlan) -> dict[str, Any]:
    """Index the shard files, attach the index to the version and link it as `<output>/index` (see the module
    docstring); an index already built from the same rows and model is re-used."""
    import pyarrow.parquet as pq

    from xbn.serving.index import META_FILE, RECALL_K
    from xbn.tracking.registry import CATALOGUE_TAG

    cfg = params.catalogue
    shards = [Path(s.output) for s in catalogue.shards]
    missing = [str(s) for s in shards if not s.exists()]
    if missing:
        raise RuntimeError(f"{len(missing)} shard(s) not embedded, e.g. {missing[0]}: the index is not built")
    output = Path(catalogue.output)
    final = output / "indexes" / f"{catalogue.fingerprint[:16]}-{catalogue.model_sha256[:16]}"
    if (final / META_FILE).exists() and (problem := _folder_problem(final)):
        log.warning("catalogue: the index built earlier in %s is not re-used: %s; building it again", final,
                    problem)
        shutil.rmtree(final)
    if not (final / META_FILE).exists():  # renamed in whole: a folder there is complete
        counts = [pq.ParquetFile(s).metadata.num_rows for s in shards]
        if not sum(counts):  # an index of nothing cannot serve; faiss would fail further down with less to say
            raise DatasetError(f"catalogue.source {cfg.source}: none of its {catalogue.rows} image(s) could be "
                               "read (each is named in the workers' log): no index built")
        dim = int((pq.read_schema(shards[0]).metadata or {}).get(b"xbn.embedding_dim", b"0"))
        work = final.with_name(f".{final.name}.{secrets.token_hex(4)}.tmp")
        try:
            meta = _build(params, shards, work, catalogue.model_sha256, sum(counts) * dim * 4)
            meta["catalogue"] = {"fingerprint": catalogue.fingerprint, "source": cfg.source, "rows": catalogue.rows,
                                 "shards": len(shards), "version": catalogue.version}
            write_json(work / META_FILE, meta)  # index.json's own digest is the registry's record of it
            if final.exists():  # an interrupted earlier attempt's leftovers, never linked
                shutil.rmtree(final)
            work.rename(final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    meta = json.loads((final / META_FILE).read_text())
    recall = float(meta[f"recall@{RECALL_K}"])
    registry = _registry(params)
    info = registry.get(catalogue.version)
    digest = file_digest(final / META_FILE)
    registry.log_index(info, final, recall, tags={CATALOGUE_TAG: f"{catalogue.fingerprint}:{digest}"})
    from xbn.stages.register import complete_awaiting_index

    complete_awaiting_index(params, info.version)  # promote last: champion now that its index is attached
    _link(output / INDEX_LINK, final)
    for old in (output / "indexes").iterdir():  # the previous catalogues' indexes (the registry keeps its copy)
        if old != final and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)
    log.info("catalogue: %s index of %d rows (recall@%d %.4f) attached to %s v%d -> %s", meta["type"],
             meta["count"], RECALL_K, recall, info.name, info.version, final)
    return {"type": meta["type"], "ondisk": bool(meta.get("ondisk")), "count": int(meta["count"]),
            f"recall@{RECALL_K}": recall, "skipped": len(meta.get("skipped", [])), "path": str(final),
            "index_sha256": digest}


def _folder_problem(folder: Path) -> str | None:
    """Why the index in `folder` must not be re-used (None: every file its index.json lists has the sha256 it
    records): renamed into place whole, but anything on this disk may have changed it since."""
    from xbn.serving.index import META_FILE

    try:
        digests = json.loads((folder / META_FILE).read_text())["sha256"]
        verify_listed(folder, digests, str(folder / META_FILE))
    except (OSError, ValueError, KeyError, TypeError, IntegrityError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _build(params: Params, shards: list[Path], work: Path, sha: str, vector_bytes: int) -> dict[str, Any]:
    """The index of `shards` in the folder `work`: in memory when the vectors fit, else on-disk IVF."""
    import pyarrow.parquet as pq

    from xbn.serving.embed_job import SKIPPED_KEY, read_embeddings
    from xbn.serving.index import CatalogueIndex
    from xbn.serving.shards import build_sharded

    skipped = [p for s in shards for p in json.loads((pq.read_schema(s).metadata or {}).get(SKIPPED_KEY, b"[]"))]
    if vector_bytes <= params.catalogue.memory_budget_gb * 2**30:
        frames, embeddings = zip(*(read_embeddings(s) for s in shards))
        catalogue = CatalogueIndex.build(np.concatenate(embeddings), pd.concat(frames, ignore_index=True),
                                         params.index, sha)
        catalogue.meta["skipped"] = skipped
        catalogue.save(work)
        return catalogue.meta
    cfg = params.index.model_copy(update={"type": params.catalogue.ondisk_type})
    meta = build_sharded(shards, work, cfg, model_sha256=sha).meta
    return {**meta, "skipped": skipped}


def _link(link: Path, target: Path) -> None:
    """Point the symlink `link` at `target` (relative), replacing the old link in one rename."""
    if link.exists() and not link.is_symlink():
        raise FileExistsError(f"{link} is a folder, not the link xbn catalogue keeps there: move it away")
    tmp = link.with_name(f".{link.name}.{secrets.token_hex(4)}.link")
    tmp.symlink_to(target.relative_to(link.parent))
    os.replace(tmp, link)
