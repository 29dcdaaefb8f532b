"""The batch embedding job: a folder or manifest CSV of images -> a parquet file (path[, label], embedding).

The images are embedded in chunks of `chunk_size` rows. Each finished chunk is written atomically into a work
folder beside the output (`.<output name>.parts/`), so a run that is killed resumes at the first missing
chunk. A `plan.json` in the work folder records what the chunks were made from (the model's sha256, the rows,
the chunk size, the image size); when any of that changed the old chunks are discarded instead of mixed in.
The output itself is assembled from the chunks and renamed into place, then the work folder is removed.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from xbn.serving.model import ServedModel
from xbn.serving.sources import local_images, read_source, rows_digest
from xbn.utils.io import atomic_path, write_json

log = logging.getLogger(__name__)

SKIPPED_KEY = b"xbn.skipped"  # parquet schema metadata: the chunk's (or output's) unreadable image paths


@dataclass
class EmbedReport:
    output: Path
    rows: int  # embedded rows written
    skipped: list[str] = field(default_factory=list)  # unreadable images, by path
    chunks_resumed: int = 0  # chunks found done from an earlier run


def work_dir(output: str | Path) -> Path:
    output = Path(output)
    return output.with_name(f".{output.name}.parts")


def embed_to_parquet(
    model: ServedModel,
    source: str | Path,
    output: str | Path,
    *,
    manifest: str | Path | None = None,
    root: str | Path | None = None,
    chunk_size: int = 1024,
    batch_size: int = 64,
    num_workers: int | str = 0,
    progress: bool = True,
    on_chunk: Callable[[int, int], None] | None = None,
) -> EmbedReport:
    """Embed every image of `source` (see `xbn.serving.sources.read_source`) into the parquet file `output`.

    `on_chunk(done, total)` is called after each chunk is safely on disk.
    """
    frame, root = read_source(source, manifest=manifest, root=root)
    return embed_rows_to_parquet(model, frame, root, output, chunk_size=chunk_size, batch_size=batch_size,
                                 num_workers=num_workers, progress=progress, on_chunk=on_chunk)


def embed_rows_to_parquet(
    model: ServedModel,
    frame: pd.DataFrame,
    root: str | Path,
    output: str | Path,
    *,
    chunk_size: int = 1024,
    batch_size: int = 64,
    num_workers: int | str = 0,
    progress: bool = True,
    on_chunk: Callable[[int, int], None] | None = None,
) -> EmbedReport:
    """`embed_to_parquet` of the rows `frame` (path relative to `root`, a local folder or an fsspec URL;
    label): one shard of a catalogue (`xbn catalogue`), or a whole one."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    frame = frame.reset_index(drop=True)
    output, parts = Path(output), work_dir(output)
    with_labels = bool(frame["label"].notna().any())
    total = -(-len(frame) // chunk_size)
    _prepare(
        parts,
        {
            "model_sha256": model.sha256,
            "image_size": model.image_size,
            "chunk_size": chunk_size,
            "rows": len(frame),
            "rows_sha256": rows_digest(frame),
        },
    )
    done = [i for i in range(total) if _chunk(parts, i).exists()]
    if done:
        log.info("embed: resuming, %d of %d chunk(s) already done in %s", len(done), total, parts)
    bar = _progress(total, len(done), progress)
    for i in range(total):
        if i in done:
            continue
        rows = frame.iloc[i * chunk_size : (i + 1) * chunk_size]
        with local_images(rows, root) as folder:
            emb, kept, skipped = model.embed_frame(rows, folder, batch_size, num_workers)
        if skipped:
            log.warning("embed: %d unreadable image(s) left out: %s", len(skipped), ", ".join(skipped))
        table = _table(rows.iloc[kept], emb, with_labels, skipped)
        with atomic_path(_chunk(parts, i)) as tmp:
            pq.write_table(table, tmp)
        bar(i + 1)
        if on_chunk is not None:
            on_chunk(i + 1, total)
    return _assemble(parts, output, total, model, len(done))


def read_embeddings(path: str | Path) -> tuple[pd.DataFrame, np.ndarray]:
    """A job's output as (frame of path[, label], float32 [N, D] embeddings)."""
    table = pq.read_table(path)
    column = table.column("embedding").combine_chunks()
    emb = column.values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    emb = emb.reshape(len(table), -1) if len(table) else np.empty((0, 0), dtype=np.float32)
    return table.drop(["embedding"]).to_pandas(), emb


def _assemble(parts: Path, output: Path, total: int, model: ServedModel, resumed: int) -> EmbedReport:
    tables = [pq.read_table(_chunk(parts, i)) for i in range(total)]
    skipped = [p for t in tables for p in json.loads((t.schema.metadata or {}).get(SKIPPED_KEY, b"[]"))]
    if tables:
        table = pa.concat_tables([t.replace_schema_metadata(None) for t in tables])
    else:
        table = _table(pd.DataFrame({"path": []}), np.empty((0, model.embedding_dim), np.float32), False, [])
    table = table.replace_schema_metadata(
        {
            SKIPPED_KEY: json.dumps(skipped).encode(),
            b"xbn.model_sha256": model.sha256.encode(),
            b"xbn.embedding_dim": str(model.embedding_dim).encode(),
        }
    )
    with atomic_path(output) as tmp:
        pq.write_table(table, tmp)
    shutil.rmtree(parts, ignore_errors=True)
    log.info("embed: %d row(s) -> %s (%d unreadable left out)", len(table), output, len(skipped))
    return EmbedReport(output, len(table), skipped, resumed)


def _prepare(parts: Path, plan: dict[str, Any]) -> None:
    """Keep the work folder's chunks only if they were made from the same plan."""
    plan_file = parts / "plan.json"
    if plan_file.exists():
        try:
            same = json.loads(plan_file.read_text()) == plan
        except ValueError:
            same = False
        if same:
            return
        log.warning("embed: %s holds chunks of another input, model or chunk size: starting over", parts)
        shutil.rmtree(parts)
    write_json(plan_file, plan)


def _table(rows: pd.DataFrame, emb: np.ndarray, with_labels: bool, skipped: list[str]) -> pa.Table:
    emb = np.ascontiguousarray(emb, dtype=np.float32)
    offsets = pa.array(np.arange(len(emb) + 1, dtype=np.int32) * emb.shape[1])
    columns = {"path": pa.array(rows["path"].astype(str).tolist(), pa.string())}
    if with_labels:
        columns["label"] = pa.array([None if pd.isna(v) else str(v) for v in rows["label"]], pa.string())
    columns["embedding"] = pa.ListArray.from_arrays(offsets, pa.array(emb.reshape(-1), pa.float32()))
    return pa.table(columns).replace_schema_metadata({SKIPPED_KEY: json.dumps(skipped).encode()})


def _chunk(parts: Path, i: int) -> Path:
    return parts / f"chunk-{i:06d}.parquet"


def _progress(total: int, initial: int, enabled: bool) -> Callable[[int], None]:
    """A chunk counter: a tqdm bar when tqdm is installed, else a log line per chunk."""
    if not enabled:
        return lambda done: None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return lambda done: log.info("embed: chunk %d/%d", done, total)
    bar = tqdm(total=total, initial=initial, unit="chunk", desc="embed")

    def update(done: int) -> None:
        bar.update(1)
        if done == total:
            bar.close()

    return update
