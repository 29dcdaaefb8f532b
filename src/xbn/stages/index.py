"""Stage `index` (after `register`): the catalogue's faiss index, built with the model just registered, and
attached to its registry version so that promoting the version promotes its index.

`xbn index` embeds `index.source` with `models/model.pt` and writes `index.output` (index.faiss, ids.parquet,
index.json with the recall@10 against exact search); `--append` adds only the images not in it yet. The
index's type, size and recall go to `index.metrics` (a DVC metric). With tracking on, the folder is logged on
the registry version whose checkpoint has models/model.pt's sha256 (`xbn register` recorded it); a model not
registered yet keeps its index on disk only, with a warning.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xbn.config import Params
from xbn.utils.faults import fault_point
from xbn.utils.io import write_json

if TYPE_CHECKING:
    from xbn.serving.model import ServedModel

# The serving modules (faiss, torch, timm: seconds in a fresh process) are imported by the functions that embed:
# `champion_index_problem` runs on every scheduled run, a nothing-changed one too, and needs only the registry.

log = logging.getLogger(__name__)


def local_model(params: Params) -> ServedModel:
    """`models/model.pt` (the trained model) on `train.device`, served at `data.image_size`."""
    path = Path(params.train.checkpoint_dir) / "model.pt"
    if not path.exists():
        raise FileNotFoundError(f"no trained model at {path}: run `xbn train` first")
    from xbn.serving.model import load_served_model
    from xbn.utils.runtime import resolve_device

    return load_served_model(path, params.data.image_size, resolve_device(params.train.device),
                             **params.inference.model_dump())


def registered_version(params: Params, sha256: str):
    """The registry version holding the checkpoint with this sha256, or None (tracking off, or not
    registered yet: logged as a warning)."""
    if not params.tracking.enabled:
        return None
    from xbn.tracking import Registry
    from xbn.tracking.registry import SHA_TAG

    registry = Registry(params)
    version = registry.find_by_tag(SHA_TAG, sha256)
    if version is None:
        log.warning("the model (sha256 %s...) is not registered in %s: its files stay on disk only "
                    "(run `xbn register` first to attach them to a version)", sha256[:12], registry.name)
    return version


def index(params: Params, append: bool = False, shards: list[str] | None = None,
          model: ServedModel | None = None) -> dict[str, Any]:
    """Build (or `append` to) the catalogue index at `index.output`, write `index.metrics`, and attach the
    folder to the model's registry version. `shards`: embedding files of `xbn embed` (one per part of a
    catalogue too large for one machine) -> an on-disk IVF index instead (`xbn.serving.shards`). `model`:
    another model than models/model.pt (a registered version's, `index_version`)."""
    from xbn.serving.index import RECALL_K, index_source

    if shards:
        from xbn.serving.shards import build_sharded, shards_model

        sha = shards_model(shards)
        catalogue = build_sharded(shards, params.index.output, params.index, model_sha256=sha)
    else:
        model = model or local_model(params)
        sha = model.sha256
        catalogue = index_source(model, params.index, manifest=params.data.manifest, root=params.data.root,
                                 append=append, num_workers=params.data.num_workers)
    recall = float(catalogue.meta[f"recall@{RECALL_K}"])
    report: dict[str, Any] = {
        "type": catalogue.meta["type"], "ondisk": bool(catalogue.meta.get("ondisk")), "count": catalogue.count,
        "dim": catalogue.dim, f"recall@{RECALL_K}": recall, "skipped": len(catalogue.meta.get("skipped", [])),
        "output": str(params.index.output), "model_sha256": sha, "version": None,
        "k_factor": catalogue.meta.get("params", {}).get("k_factor"),  # a refined IVF-PQ's, tuned at build
    }
    version = registered_version(params, sha)
    if version is not None:
        from xbn.stages.register import complete_awaiting_index
        from xbn.tracking import Registry

        Registry(params).log_index(version, params.index.output, recall)
        report["version"] = version.version
        log.info("index attached to %s v%d", version.name, version.version)
        fault_point("index.after_attach")
        # Promote last: a version the gate promoted becomes champion now that it can serve.
        if (completed := complete_awaiting_index(params, version.version)) is not None:
            report["champion"] = completed["champion_version"] == version.version  # `xbn summary` reads it
            log.info("%s v%d: %s", version.name, version.version,
                     "champion now, with its index" if report["champion"] else
                     f"not made champion: {completed['reason']}")
    write_json(params.index.metrics, report)
    log.info("index: %s, %d items, recall@%d %.4f -> %s", report["type"], report["count"], RECALL_K, recall,
             params.index.output)
    return report


def champion_index_problem(params: Params) -> dict[str, Any] | None:
    """The champion and why it cannot serve its index (none attached: a run killed between the promotion and
    the index; lost or altered in the artifact store), or None when it can, or there is no champion. A
    scheduled run checks this before it decides that nothing changed, so such a champion is repaired."""
    from xbn.stages.promotion import CHAMPION
    from xbn.tracking import Registry

    registry = Registry(params)
    champion = registry.by_alias(CHAMPION)
    if champion is None:
        return None
    problem = registry.index_problem(champion)
    return None if problem is None else {"version": champion.version, "problem": problem}


def index_version(params: Params, version: int) -> dict[str, Any]:
    """Index `index.source` with registry version `version`'s own checkpoint (downloaded and sha256-verified)
    and attach it to that version: a champion's index rebuilt without retraining."""
    import tempfile

    from xbn.serving.model import load_served_model
    from xbn.tracking import Registry
    from xbn.utils.runtime import resolve_device

    registry = Registry(params)
    with tempfile.TemporaryDirectory(prefix="xbn-index-model-") as tmp:
        registered = registry.checkpoint(registry.get(version), tmp)
        model = load_served_model(registered.path, registered.image_size or params.data.image_size,
                                  resolve_device(params.train.device), **params.inference.model_dump())
        return index(params, model=model)
