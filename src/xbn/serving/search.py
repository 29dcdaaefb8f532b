"""Rank a catalogue for query images: the logic behind `xbn search` and the HTTP `/search`, and its output as
a table or as JSON.

Each query answers on its own: an image that cannot be read becomes an entry with an `error` naming the file,
and the other images are still searched.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from xbn.serving.index import CatalogueIndex
from xbn.serving.model import ServedModel, UnreadableImage, open_image

log = logging.getLogger(__name__)


def neighbours(index: CatalogueIndex, embeddings: np.ndarray, k: int) -> list[list[dict[str, Any]]]:
    """For each embedding, its top-k catalogue items as {path, label, score, rank, row} (rank 1 = closest; row:
    the item's row in the index and its id map)."""
    scores, rows = index.search(embeddings, k)
    # Only the rows found are read from the id map (a 10M-row map converted whole would cost seconds).
    found = np.unique(rows[rows >= 0])
    paths = dict(zip(found.tolist(), index.ids["path"].take(found).tolist()))
    labels = dict(zip(found.tolist(), index.ids["label"].take(found).tolist()))
    # pandas reads a label column with some nulls as strings with NaN for the nulls: pd.isna catches both.
    return [
        [
            {
                "path": str(paths[r]),
                "label": None if pd.isna(labels[r]) else str(labels[r]),
                "score": round(float(s), 6),
                "rank": rank,
                "row": r,
            }
            for rank, (s, r) in enumerate(zip(row_scores, row_ids.tolist()), start=1)
            if r >= 0
        ]
        for row_scores, row_ids in zip(scores, rows)
    ]


def search_images(
    model: ServedModel,
    index: CatalogueIndex,
    image_paths: Sequence[str | Path],
    k: int = 10,
    batch_size: int = 64,
) -> list[dict[str, Any]]:
    """One entry per image, in order: {"query", "results": [{path, label, score, rank}, ...]}, or
    {"query", "error"} when the image cannot be read (the others still answer)."""
    index.check_model(model.sha256)
    out: list[dict[str, Any]] = []
    for start in range(0, len(image_paths), batch_size):  # bounds how many decoded images are held at once
        entries, images = [], []
        for path in image_paths[start : start + batch_size]:
            entry: dict[str, Any] = {"query": str(path)}
            try:
                images.append(open_image(path, model.decode_side))
                entries.append(entry)
            except UnreadableImage as exc:
                log.error("%s", exc)
                entry["error"] = str(exc)
            out.append(entry)
        if images:
            for entry, results in zip(entries, neighbours(index, model.embed_images(images), k)):
                entry["results"] = results
    return out


def format_json(results: list[dict[str, Any]]) -> str:
    return json.dumps(results, indent=2)


def format_table(results: list[dict[str, Any]]) -> str:
    """A plain-text table per query: rank, score, label, path; an unreadable query shows its error."""
    blocks = []
    for entry in results:
        lines = [f"query: {entry['query']}"]
        if "error" in entry:
            lines.append(f"  error: {entry['error']}")
        else:
            rows = [
                (str(r["rank"]), f"{r['score']:.4f}", r["label"] or "-", r["path"]) for r in entry["results"]
            ]
            header = ("rank", "score", "label", "path")
            widths = [
                max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)
            ]
            for row in (header, *rows):
                lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
