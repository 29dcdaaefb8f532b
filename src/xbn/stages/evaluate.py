"""Stage `evaluate`: retrieval metrics of the selected model on the test protocol -> `metrics/eval.json`."""

from __future__ import annotations

import logging
from pathlib import Path

from xbn.config import Params
from xbn.data import read_manifest
from xbn.evaluation.embed import embed_split, evaluate_split, retrieval_protocol
from xbn.evaluation.engine import engined, settled_choice
from xbn.evaluation.inference import inference_mode
from xbn.evaluation.mpn_rerank import mpn_retrieval_metrics
from xbn.evaluation.served import model_engine
from xbn.models import build_embedder, load_embedder
from xbn.models.mpn import load_mpn
from xbn.stages.refine import evaluate_refined
from xbn.utils.io import file_digest, write_csv, write_json
from xbn.utils.runtime import resolve_device, seed_everything

log = logging.getLogger(__name__)


def model_path(params: Params) -> Path:
    return Path(params.train.checkpoint_dir) / "model.pt"


def evaluate(params: Params) -> dict:
    """Score `models/model.pt` on `eval.split` (as `xbn evaluate`): recall@k, MAP@R, R-precision and NMI, and
    the untrained model's for comparison; writes and returns `eval.output` (metrics/eval.json)."""
    path = model_path(params)
    if not path.exists():
        raise FileNotFoundError(f"no trained model at {path}: run `xbn train` first")
    device = resolve_device(params.train.device)
    manifest = read_manifest(params.data.manifest)
    model, data_config, checkpoint = load_embedder(path, map_location=device)
    model.to(device)
    mode = inference_mode(params, model, device)
    # `inference.engine`: ONNX Runtime on the model's graph where auto measures it faster (the untrained
    # baseline below has other weights and runs in torch)
    engine = model_engine(model, data_config, params.data.image_size, file_digest(path), device,
                          params.inference.engine)
    trained = engined(model, engine)

    def score(m, **kwargs):
        return evaluate_split(
            m, manifest, params.data.root, params.eval.split, image_size=params.data.image_size,
            mean=data_config["mean"], std=data_config["std"], ks=params.eval.k, batch_size=params.eval.batch_size,
            num_workers=params.data.num_workers, device=device, mode=mode,
            query_chunk=params.eval.query_chunk, **kwargs)

    metrics, (q_emb, q_lab, r_emb, r_lab) = score(trained, return_embeddings=True)
    metrics["epoch"] = checkpoint.get("epoch")
    # bf16, channels_last, onnxruntime (1/0), the probe's and the engines' rates: logged to MLflow
    metrics["inference"] = {**mode.record(), **settled_choice(engine).record()}
    skipped = metrics.pop("skipped_images")  # logged by name; eval.json keeps the count (numbers only)
    spectrum = _embedding_space(params, trained, manifest, data_config, device, mode, metrics, q_emb, q_lab, r_emb,
                                r_lab)
    if params.model.mpn.test_time:  # Intra-Batch's ablation: the MPN at test time, next to the plain metrics
        metrics["mpn"] = _mpn_metrics(params, device, q_emb, q_lab, r_emb, r_lab)

    # Seed 001, Algorithm 2: refined queries against refined references (same metric names), when the refiner is on.
    if (refined := evaluate_refined(params, q_emb, q_lab, r_emb, r_lab, path, device)) is not None:
        metrics["refined"] = refined
    if params.eval.baseline:
        seed_everything(params.train.seed)  # the same fresh head the training run started from
        fresh, _ = build_embedder(params.model)
        untrained = mode.prepare(fresh.to(device))
        metrics["untrained"] = {k: v for k, v in score(untrained).items() if "@" in k or k == "nmi"}
    write_json(params.eval.output, metrics)
    write_csv(Path(params.eval.output).with_name("recall_at_k.csv"),
              [{"k": k, "recall": metrics[f"recall@{k}"]} for k in params.eval.k])
    write_csv(Path(params.eval.output).with_name("spectrum.csv"), spectrum,  # header only when disabled
              ["index", "singular_value", "normalized"])
    if params.tracking.enabled:
        # The grid pairs rows with embeddings: leave out the images the embedding pass skipped.
        _track(params, manifest[~manifest["path"].isin(skipped)], q_emb, r_emb)
    log.info("R@1 %.4f  MAP@R %.4f -> %s", metrics["recall@1"], metrics["map@r"], params.eval.output)
    return metrics


def _embedding_space(params: Params, model, manifest, data_config, device, mode, metrics: dict, q_emb, q_lab,
                     r_emb, r_lab) -> list[dict]:
    """Roth et al. 2020's embedding-space metrics into `metrics` (top-level numbers, so they reach MLflow),
    from the training split's embeddings and the evaluated split's; returns the training spectrum's rows."""
    if not params.eval.embedding_space:
        return []
    from xbn.evaluation.embedding_space import embedding_space_metrics, spectrum_rows

    train_emb, train_lab = embed_split(
        model, manifest, params.data.root, "train", image_size=params.data.image_size, mean=data_config["mean"],
        std=data_config["std"], batch_size=params.eval.batch_size, num_workers=params.data.num_workers,
        device=device, mode=mode)
    values, spectrum = embedding_space_metrics(
        train_emb, train_lab, q_emb, q_lab, r_emb, r_lab, spectrum_skip=params.eval.spectrum_skip,
        seed=params.train.seed, chunk_size=params.eval.query_chunk, device=str(device))
    metrics.update(values)
    return spectrum_rows(spectrum)


def _mpn_metrics(params: Params, device, q_emb, q_lab, r_emb, r_lab) -> dict:
    """Retrieval metrics after the trained MPN (`models/mpn.pt`) refines each embedding over its expanded
    k-reciprocal neighbourhood (`model.mpn.test_k`), test_size nodes (null: the training batch's)."""
    mpn = load_mpn(Path(params.train.checkpoint_dir) / "mpn.pt", map_location=device)
    cfg = params.model.mpn
    return mpn_retrieval_metrics(mpn, q_emb, q_lab, r_emb, r_lab, k=cfg.test_k,
                                 size=cfg.test_size or params.train.batch_size, ks=params.eval.k,
                                 chunk_size=params.eval.query_chunk, device=str(device))


def _track(params: Params, manifest, query_embeddings, reference_embeddings) -> None:
    from xbn.tracking import RETRIEVAL_GRID, log_evaluation, pipeline_run, retrieval_grid_from_embeddings

    queries, references = retrieval_protocol(manifest, params.eval.split)
    grid = retrieval_grid_from_embeddings(params.data.root, queries, query_embeddings, references,
                                          reference_embeddings, RETRIEVAL_GRID)
    with pipeline_run(params, "evaluate") as run:
        log_evaluation(params, run, grid)
