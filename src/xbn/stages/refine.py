"""Stage `refine`: train the neighbourhood-context refiner (`xbn.models.refiner`) on frozen embeddings.

What the refiner trains on: augmented views of the training split. `models/model.pt` embeds the training
images `refine.views` times through a training transform (`refine.views_augment`: light, a random crop of half
the image or more and a flip; full, the backbone's own recipe with RandAugment and erasing), and each view's
neighbourhoods are found within that view. Light is the default: under the full recipe the views' R@1 was
0.09-0.13 against val's 0.59-0.82 (glyphs, Omniglot), neighbourhoods nothing like test time, and the refiner
never beat the identity on Omniglot; light views (R@1 0.25-0.40) gave the higher val R@1 on both sets
(`python -m benchmarks grid --regime refine`, docs/benchmarks.md section 9). Why views at all: the backbone
fits the training split, so the eval-transform embeddings of training images sit in near-pure class
clusters (their leave-one-out R@1 is far above val's) and the refiner sees only neighbourhoods that need no
correction; it then learns the identity and epoch 0 is kept. Augmented views spread those clusters and mix
in other classes' neighbours, as unseen test classes do, and every view is new data. The alternatives were
worse here: a held-out fold of training classes would need a second backbone trained without it, and the
class-disjoint val split is what selects the refiner (and `serve: auto`), so training on it would bias that
choice. `refine.views: 0` trains on the eval-transform embeddings. The metrics file reports the training
views' R@1 next to val's, so how test-like they were is visible.

Training (Eq. 4, Algorithm 1): each batch's embeddings are refined against their k nearest neighbours (in
their own view, the embedding itself excluded) and PML's MultiSimilarityLoss is taken between the refined
embeddings. Inference (Algorithm 2): queries and references are both refined against their k nearest
references, and retrieval compares refined with refined. The epoch with the best validation R@1 is kept
(epoch 0 is the untrained refiner, the identity), and `refine.serve` decides which embedding is served
(`auto`: refined only if it beats plain on validation). The test protocol (`eval.split`) is then scored
plain and refined for the report only; it never selects anything.

With `refine.enabled: false` the stage writes only a 'disabled' marker at `refine.output` and
`{"enabled": false}` at `refine.metrics`, so the DVC graph stays whole at no cost.
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from xbn.config import ConfigError, Params
from xbn.data import ClassBalancedBatchSampler, build_transform, encode_labels, read_manifest
from xbn.evaluation.embed import embed, embed_protocol, image_loader
from xbn.evaluation.inference import inference_mode
from xbn.evaluation.knn import knn_search
from xbn.evaluation.metrics import retrieval_metrics
from xbn.models import load_embedder
from xbn.models.refiner import ContextRefiner, load_refiner, save_refiner
from xbn.utils.io import file_digest, write_json
from xbn.utils.runtime import resolve_device, seed_everything

if TYPE_CHECKING:
    from typing_extensions import TypeIs

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

    device = resolve_device(params.train.device)
    model, data_config, _ = load_embedder(model_path, map_location=device)
    mode = inference_mode(params, model, device)
    if model.embedding_dim % cfg.heads:
        raise ConfigError(f"refine.heads ({cfg.heads}) must divide model.embedding_dim "
                          f"({model.embedding_dim})")
    manifest = read_manifest(params.data.manifest)
    codes = dict(zip(manifest["label"], encode_labels(manifest["label"])))

    def embed_split(split: str, training: bool = False) -> tuple[torch.Tensor, np.ndarray] | None:
        frame = manifest[manifest["split"] == split]
        if frame.empty:
            return None
        transform = build_transform(params.data.image_size, training=training, mean=data_config["mean"],
                                    std=data_config["std"], augment=cfg.views_augment)
        loader = image_loader(frame, params.data.root, frame["label"].map(codes).to_numpy(), transform,
                              params.eval.batch_size, params.data.num_workers, device)
        emb, labels = embed(model, loader, device, mode)
        return torch.from_numpy(emb), labels

    seed_everything(cfg.seed)  # the augmented views are drawn reproducibly
    views = [embed_split("train", training=True) for _ in range(cfg.views)] or [embed_split("train")]
    train = [v for v in views if v is not None]  # the same split each time: all views, or none
    if not train:
        raise ValueError(f"{params.data.manifest} has no 'train' rows")
    summary = fit_refiner(params, train, embed_split("val"), device)
    summary["embedder_sha256"] = file_digest(model_path)
    # The test protocol, plain and refined with the selected refiner: reported, never selected on.
    test = embed_protocol(model, manifest, params.data.root, params.eval.split, image_size=params.data.image_size,
                          mean=data_config["mean"], std=data_config["std"], batch_size=params.eval.batch_size,
                          num_workers=params.data.num_workers, device=device, mode=mode)
    protocol = (test.query_emb, test.query_labels, test.reference_emb, test.reference_labels)
    summary["test_plain_recall@1"] = retrieval_metrics(*protocol, ks=(1,), nmi=False,
                                                       device=str(device))["recall@1"]
    summary["test_refined_recall@1"] = refined_metrics(summary["refiner"], *protocol, cfg.k, ks=(1,), nmi=False,
                                                       device=device)["recall@1"]
    save_refiner(cfg.output, summary.pop("refiner"), {k: summary[k] for k in
                                                      ("k", "served", "epoch", "embedder_sha256")})
    # The per-epoch rows stay out of the DVC metrics file (they are returned and printed by the CLI).
    write_json(cfg.metrics, {k: v for k, v in summary.items() if k != "history"})
    log.info("refiner: R@1 plain -> refined: val %s -> %s (epoch %s), %s %s -> %s; serving %s -> %s",
             summary["val_plain_recall@1"], summary["val_refined_recall@1"], summary["epoch"], params.eval.split,
             summary["test_plain_recall@1"], summary["test_refined_recall@1"], summary["served"], cfg.output)
    return summary


TrainSet = tuple[torch.Tensor, np.ndarray]


def _one_view(views: TrainSet | Sequence[TrainSet]) -> TypeIs[TrainSet]:
    return isinstance(views[0], (torch.Tensor, np.ndarray))


def fit_refiner(params: Params, train_views: TrainSet | Sequence[TrainSet], val_set: TrainSet | None,
                device: torch.device | str = "cpu") -> dict:
    """Train a refiner on one or more views (embeddings, labels) of the train split, select it on val; returns
    the summary with the selected refiner under "refiner"."""
    from pytorch_metric_learning.losses import MultiSimilarityLoss

    cfg = params.refine
    seed_everything(cfg.seed)
    device = torch.device(device)
    if _one_view(train_views):
        train_views = [train_views]
    train_emb, train_labels, train_ctx = pooled_contexts(train_views, cfg.k, device)
    train_plain = float(np.mean([retrieval_metrics(e, y, ks=(1,), nmi=False)["recall@1"] for e, y in train_views]))
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
            loss = batch_loss(refiner, loss_fn, train_emb[rows], train_emb[train_ctx[rows]], labels[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        score = val_recall()
        history.append({"epoch": epoch, "loss": float(np.mean(losses)), "val_recall@1": score})
        if score is None or best_score is None or score > best_score:  # no val split: the last epoch is kept
            best_score, best_epoch, best_state = score, epoch, copy.deepcopy(refiner.state_dict())
    refiner.load_state_dict(best_state)
    refiner.eval()
    if cfg.serve == "auto":
        served = "refined" if best_score is not None and plain is not None and best_score > plain else "plain"
    else:
        served = cfg.serve
    return {"enabled": True, "k": cfg.k, "epoch": best_epoch, "served": served, "refiner": refiner,
            "views": len(train_views), "views_augment": cfg.views_augment, "train_plain_recall@1": train_plain,
            "val_plain_recall@1": plain, "val_refined_recall@1": best_score, "history": history}


def context_indices(queries, references, k: int, *, chunk_size: int = 4096,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """The k nearest references of each query (faiss, by inner product) as a [N, k] index tensor on `device`.
    `references` None: leave-one-out within `queries`, each query's own row excluded from its context."""
    leave_one_out = references is None
    _, idx = knn_search(queries, queries if leave_one_out else references, k, exclude_self=leave_one_out,
                        chunk_size=chunk_size, device=device)
    return torch.from_numpy(idx).to(device)


def pooled_contexts(views: Sequence[TrainSet], k: int, device: torch.device | str = "cpu"
                    ) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
    """All views in one pool: (embeddings [N, d], labels [N], contexts [N, k] into the pool); each row's
    context is its k nearest rows of its own view, itself excluded (a view is one pass over the split)."""
    emb = torch.cat([torch.as_tensor(e, dtype=torch.float32) for e, _ in views]).to(device)
    offsets = np.cumsum([0] + [len(e) for e, _ in views])
    ctx = torch.cat([context_indices(emb[s:t], None, k, device=device) + int(s)
                     for s, t in itertools.pairwise(offsets)])
    return emb, np.concatenate([np.asarray(y) for _, y in views]), ctx


def batch_loss(refiner: ContextRefiner, loss_fn, z: torch.Tensor, context: torch.Tensor,
               labels: torch.Tensor) -> torch.Tensor:
    """Eq. 4: the multi-similarity loss over all pairs of the batch's refined embeddings."""
    return loss_fn(refiner(z, context), labels)


def refine_both(refiner: ContextRefiner, q_emb, r_emb=None, k: int = 8, *, chunk_size: int = 4096,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Algorithm 2: (refined queries, refined references; None for leave-one-out). Every reference is refined
    against its k nearest other references, every query against its k nearest references (leave-one-out: the
    queries are the references, each left out of its own context)."""
    device = torch.device(device)
    q = torch.as_tensor(q_emb, dtype=torch.float32, device=device)
    r = q if r_emb is None else torch.as_tensor(r_emb, dtype=torch.float32, device=device)
    refiner = refiner.to(device)
    refined_r = refiner.refine(r, r, context_indices(r, None, k, chunk_size=chunk_size, device=device), chunk_size)
    if r_emb is None:
        return refined_r, None
    return refiner.refine(q, r, context_indices(q, r, k, chunk_size=chunk_size, device=device), chunk_size), refined_r


def refined_metrics(refiner: ContextRefiner, q_emb, q_labels, r_emb, r_labels, k: int, *, ks=(1,),
                    nmi: bool = True, chunk_size: int = 4096, device: torch.device | str = "cpu") -> dict:
    """Retrieval metrics of refined queries against refined references (`refine_both`); leave-one-out
    (`r_emb` None) searches each refined item among the other refined items."""
    refined_q, refined_r = refine_both(refiner, q_emb, r_emb, k, chunk_size=chunk_size, device=device)
    return retrieval_metrics(refined_q.cpu(), q_labels, None if refined_r is None else refined_r.cpu(),
                             None if refined_r is None else r_labels, ks=tuple(ks), chunk_size=chunk_size,
                             device=str(torch.device(device)), nmi=nmi)


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


__all__ = ["batch_loss", "context_indices", "evaluate_refined", "fit_refiner", "pooled_contexts", "refine",
           "refine_both", "refined_metrics"]
