"""Stage `refine`: train the neighbourhood-context refiner (`xbn.models.refiner`) on frozen embeddings.

`models/model.pt` embeds the train and val splits once; faiss finds each embedding's k nearest neighbours in
its own split once (the embedding itself excluded), and those neighbourhoods are the contexts for the whole
training. The refined embedding of an anchor is scored by PML's MultiSimilarityLoss against the *plain*
embeddings of its class-balanced batch, because retrieval compares a refined query with the plain reference
set: the gallery index stays the plain one and only the query passes through the refiner. The epoch with the
best validation R@1 is kept (epoch 0 is the untrained refiner, the identity), and `refine.serve` decides which
embedding is served (`auto`: refined only if it beats plain on validation).

With `refine.enabled: false` the stage writes only a 'disabled' marker at `refine.output` and
`{"enabled": false}` at `refine.metrics`, so the DVC graph stays whole at no cost.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import numpy as np
import torch

from xbn.config import ConfigError, Params
from xbn.data import ClassBalancedBatchSampler, build_transform, encode_labels, read_manifest
from xbn.evaluation.embed import embed, image_loader
from xbn.evaluation.knn import knn_search
from xbn.evaluation.metrics import retrieval_metrics
from xbn.models.refiner import ContextRefiner, load_refiner, save_refiner
from xbn.utils.runtime import resolve_device, seed_everything
from xbn.utils.io import file_digest, write_json

log = logging.getLogger(__name__)


def refine(params: Params) -> dict:
    cfg = params.refine
    if not cfg.enabled:
        save_refiner(cfg.output, None, {})
        write_json(cfg.metrics, {"enabled": False})
        return {"enabled": False}
    model_path = Path(params.train.checkpoint_dir) / "model.pt"
    if not model_path.exists():
        raise FileNotFoundError(f"no trained model at {model_path}: run `xbn train` first")
    from xbn.models import load_embedder

    device = resolve_device(params.train.device)
    model, data_config, _ = load_embedder(model_path, map_location=device)
    if model.embedding_dim % cfg.heads:
        raise ConfigError(f"refine.heads ({cfg.heads}) must divide model.embedding_dim "
                          f"({model.embedding_dim})")
    manifest = read_manifest(params.data.manifest)
    codes = dict(zip(manifest["label"], encode_labels(manifest["label"])))
    transform = build_transform(params.data.image_size, training=False, mean=data_config["mean"],
                                std=data_config["std"])

    def embed_split(split: str) -> tuple[torch.Tensor, np.ndarray] | None:
        frame = manifest[manifest["split"] == split]
        if frame.empty:
            return None
        loader = image_loader(frame, params.data.root, frame["label"].map(codes).to_numpy(), transform,
                              params.eval.batch_size, params.data.num_workers, device)
        emb, labels = embed(model, loader, device, params.train.amp)
        return torch.from_numpy(emb), labels

    train_set, val_set = embed_split("train"), embed_split("val")
    if train_set is None:
        raise ValueError(f"{params.data.manifest} has no 'train' rows")
    summary = fit_refiner(params, train_set, val_set, device)
    summary["embedder_sha256"] = file_digest(model_path)
    save_refiner(cfg.output, summary.pop("refiner"), {k: summary[k] for k in
                                                      ("k", "served", "epoch", "embedder_sha256")})
    # The per-epoch rows stay out of the DVC metrics file (they are returned and printed by the CLI).
    write_json(cfg.metrics, {k: v for k, v in summary.items() if k != "history"})
    log.info("refiner: val R@1 plain %s refined %s (epoch %s), serving %s -> %s",
             summary["val_plain_recall@1"], summary["val_refined_recall@1"], summary["epoch"], summary["served"],
             cfg.output)
    return summary


def fit_refiner(params: Params, train_set: tuple[torch.Tensor, np.ndarray],
                val_set: tuple[torch.Tensor, np.ndarray] | None, device: torch.device | str = "cpu") -> dict:
    """Train a refiner on (embeddings, labels) of the train split, select it on val; returns the summary with
    the selected refiner under "refiner"."""
    from pytorch_metric_learning.losses import MultiSimilarityLoss
    from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

    cfg = params.refine
    seed_everything(cfg.seed)
    device = torch.device(device)
    train_emb, train_labels = train_set[0].to(device), train_set[1]
    train_ctx = context_indices(train_emb, None, cfg.k, device=device)  # once, on the frozen embeddings
    labels = torch.as_tensor(train_labels, device=device)

    refiner = ContextRefiner(train_emb.shape[1], cfg.blocks, cfg.heads).to(device)
    loss_fn = MultiSimilarityLoss(**cfg.loss_params)
    optimizer = torch.optim.AdamW(refiner.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sampler = ClassBalancedBatchSampler(train_labels, cfg.batch_size, cfg.samples_per_class, seed=cfg.seed)

    def val_recall() -> float | None:
        if val_set is None:
            return None
        return refined_metrics(refiner, val_set[0], val_set[1], None, None, cfg.k, ks=(1,), nmi=False,
                               device=device)["recall@1"]

    plain = (retrieval_metrics(val_set[0], val_set[1], ks=(1,), nmi=False)["recall@1"]
             if val_set is not None else None)
    best_score, best_epoch, best_state = val_recall(), 0, copy.deepcopy(refiner.state_dict())
    history = []
    for epoch in range(1, cfg.epochs + 1):
        sampler.set_epoch(epoch)
        refiner.train()
        losses = []
        for batch in sampler:
            rows = torch.as_tensor(batch, device=device)
            z, y = train_emb[rows], labels[rows]
            refined = refiner(z, train_emb[train_ctx[rows]])
            # Pairs within the batch, each anchor's own plain row excluded (labels == ref_labels by identity).
            pairs = lmu.get_all_pairs_indices(y)
            loss = loss_fn(refined, y, pairs, ref_emb=z, ref_labels=y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        score = val_recall()
        history.append({"epoch": epoch, "loss": float(np.mean(losses)), "val_recall@1": score})
        if score is None or score > best_score:  # no val split: the last epoch is kept
            best_score, best_epoch, best_state = score, epoch, copy.deepcopy(refiner.state_dict())
    refiner.load_state_dict(best_state)
    refiner.eval()
    if cfg.serve == "auto":
        served = "refined" if best_score is not None and plain is not None and best_score > plain else "plain"
    else:
        served = cfg.serve
    return {"enabled": True, "k": cfg.k, "epoch": best_epoch, "served": served, "refiner": refiner,
            "val_plain_recall@1": plain, "val_refined_recall@1": best_score, "history": history}


def context_indices(queries, references, k: int, *, chunk_size: int = 4096,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """The k nearest references of each query (faiss, by inner product) as a [N, k] index tensor on `device`.
    `references` None: leave-one-out within `queries`, each query's own row excluded from its context."""
    leave_one_out = references is None
    _, idx = knn_search(queries, queries if leave_one_out else references, k, exclude_self=leave_one_out,
                        chunk_size=chunk_size, device=device)
    return torch.from_numpy(idx).to(device)


def refined_metrics(refiner: ContextRefiner, q_emb, q_labels, r_emb, r_labels, k: int, *, ks=(1,),
                    nmi: bool = True, chunk_size: int = 4096, device: torch.device | str = "cpu") -> dict:
    """Retrieval metrics of refined queries against the plain references.

    Query -> gallery (`r_emb` given): each query's context is its k nearest gallery embeddings. Leave-one-out
    (`r_emb` None): the queries are the references, and query i is left out both of its own context and of
    its own search (`exclude`), so it never sees itself.
    """
    device = torch.device(device)
    q = torch.as_tensor(q_emb, dtype=torch.float32, device=device)
    leave_one_out = r_emb is None
    r = q if leave_one_out else torch.as_tensor(r_emb, dtype=torch.float32, device=device)
    ctx = context_indices(q, None if leave_one_out else r, k, chunk_size=chunk_size, device=device)
    refined = refiner.to(device).refine(q, r, ctx, chunk_size)
    exclude = np.arange(len(q)) if leave_one_out else None
    return retrieval_metrics(refined.cpu(), q_labels, r.cpu(), q_labels if leave_one_out else r_labels,
                             ks=tuple(ks), chunk_size=chunk_size, device=str(device), nmi=nmi,
                             exclude=exclude)


def evaluate_refined(params: Params, q_emb, q_labels, r_emb, r_labels, model_path: str | Path,
                     device: torch.device | str = "cpu") -> dict | None:
    """The `refined` section of eval.json, or None when refinement is off. The refiner must have been
    trained on the embeddings of `model_path`."""
    path = Path(params.refine.output)
    if not params.refine.enabled or not path.exists():
        return None
    refiner, checkpoint = load_refiner(path, map_location=device)
    if refiner is None:
        return None
    if checkpoint["embedder_sha256"] != file_digest(model_path):
        raise ValueError(f"{path} was trained on the embeddings of another {model_path}: run `xbn refine`")
    metrics = refined_metrics(refiner, q_emb, q_labels, r_emb, r_labels, checkpoint["k"], ks=params.eval.k,
                              chunk_size=params.eval.query_chunk, device=device)
    return {**metrics, "served": checkpoint["served"] == "refined"}


__all__ = ["context_indices", "evaluate_refined", "fit_refiner", "refine", "refined_metrics"]
