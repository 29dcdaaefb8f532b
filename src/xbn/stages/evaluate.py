"""Stage `evaluate`: retrieval metrics of the selected model on the test protocol -> `metrics/eval.json`."""

from __future__ import annotations

import logging
from pathlib import Path


from xbn.config import Params
from xbn.data import read_manifest
from xbn.evaluation.embed import evaluate_split
from xbn.models import build_embedder, load_embedder
from xbn.training.trainer import resolve_device, seed_everything, write_csv
from xbn.utils.io import write_json

log = logging.getLogger(__name__)


def model_path(params: Params) -> Path:
    return Path(params.train.checkpoint_dir) / "model.pt"


def evaluate(params: Params) -> dict:
    path = model_path(params)
    if not path.exists():
        raise FileNotFoundError(f"no trained model at {path}: run `xbn train` first")
    device = resolve_device(params.train.device)
    manifest = read_manifest(params.data.manifest)
    model, data_config, checkpoint = load_embedder(path, map_location=device)
    model.to(device)

    def score(m, **kwargs):
        return evaluate_split(
            m, manifest, params.data.root, params.eval.split, image_size=params.data.image_size,
            mean=data_config["mean"], std=data_config["std"], ks=params.eval.k, batch_size=params.eval.batch_size,
            num_workers=params.data.num_workers, device=device, amp=params.train.amp,
            query_chunk=params.eval.query_chunk, **kwargs)

    metrics, (q_emb, _, r_emb, _) = score(model, return_embeddings=True)
    metrics["epoch"] = checkpoint.get("epoch")
    if params.eval.baseline:
        seed_everything(params.train.seed)  # the same fresh head the training run started from
        untrained, _ = build_embedder(params.model)
        metrics["untrained"] = {k: v for k, v in score(untrained.to(device)).items() if "@" in k or k == "nmi"}
    write_json(params.eval.output, metrics)
    write_csv(Path(params.eval.output).with_name("recall_at_k.csv"),
              [{"k": k, "recall": metrics[f"recall@{k}"]} for k in params.eval.k])
    if params.tracking.enabled:
        _track(params, manifest, q_emb, r_emb)
    log.info("R@1 %.4f  MAP@R %.4f -> %s", metrics["recall@1"], metrics["map@r"], params.eval.output)
    return metrics


def _track(params: Params, manifest, query_embeddings, reference_embeddings) -> None:
    from xbn.evaluation.embed import retrieval_protocol
    from xbn.tracking import RETRIEVAL_GRID, log_evaluation, pipeline_run, retrieval_grid_from_embeddings

    queries, references = retrieval_protocol(manifest, params.eval.split)
    grid = retrieval_grid_from_embeddings(params.data.root, queries, query_embeddings, references,
                                          reference_embeddings, RETRIEVAL_GRID)
    with pipeline_run(params, "evaluate") as run:
        log_evaluation(params, run, grid)
