"""Intra-Batch at test time (Seidenschwarz et al., ICML 2021, ablation): the trained MPN refines each item's
embedding over the graph of the item and its k-reciprocal neighbours, and retrieval is scored on the refined
embeddings.

j is a k-reciprocal neighbour of i when each is among the other's k nearest. Testing "i among j's k nearest"
needs no second search: it holds when sim(i, j) reaches j's k-th best similarity inside the reference set, so
one search of the references against themselves serves both protocols. With a query -> gallery protocol the
gallery items are refined over their own neighbourhoods in the gallery, so queries and gallery live in the
same (MPN output) space; leave-one-out refines every item over its neighbours among the others.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from xbn.evaluation.knn import as_float32_matrix, knn_search
from xbn.evaluation.metrics import retrieval_metrics
from xbn.models.mpn import MessagePassingNetwork


def reciprocal_neighbours(queries: np.ndarray, references: np.ndarray, k: int, *, leave_one_out: bool,
                          chunk_size: int = 4096, device: Any = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """(indices [Nq, k] into references, valid [Nq, k]): each query's k nearest references, and which of them
    are k-reciprocal. With `leave_one_out` queries are the references and each item's own row is excluded."""
    ref_sims, ref_idx = knn_search(references, references, k, exclude_self=True, chunk_size=chunk_size,
                                   device=device)
    # j's k-th best similarity to another reference (a one-item set has none: every neighbour is reciprocal)
    kth = ref_sims[:, -1] if ref_sims.shape[1] else np.full(len(references), -np.inf, np.float32)
    if leave_one_out:  # the queries are the references
        sims, idx = ref_sims, ref_idx
    else:
        sims, idx = knn_search(queries, references, k, chunk_size=chunk_size, device=device)
    return idx, sims >= kth[idx]


@torch.no_grad()
def refine(mpn: MessagePassingNetwork, queries: np.ndarray, references: np.ndarray, idx: np.ndarray,
           valid: np.ndarray, *, chunk_size: int = 1024, device: Any = "cpu") -> np.ndarray:
    """Each query's MPN output at its own node of the graph {query} + its neighbours `idx` where `valid` (the
    rest padded and masked out), L2-normalised."""
    mpn = mpn.to(device).eval()
    q = torch.from_numpy(queries)
    r = torch.from_numpy(references)
    out = []
    for start in range(0, len(q), chunk_size):
        rows = slice(start, start + chunk_size)
        nodes = torch.cat([q[rows, None], r[torch.from_numpy(idx[rows])]], dim=1).to(device)
        padding = torch.from_numpy(np.concatenate([np.zeros((len(nodes), 1), bool), ~valid[rows]], axis=1))
        out.append(F.normalize(mpn(nodes, padding.to(device))[:, 0].float(), dim=-1).cpu())
    return torch.cat(out).numpy() if out else np.zeros_like(queries)


def mpn_retrieval_metrics(mpn: MessagePassingNetwork, query_emb, query_labels, reference_emb=None,
                          reference_labels=None, *, k: int, ks=(1, 2, 4, 8), chunk_size: int = 4096,
                          device: Any = "cpu", nmi: bool = True) -> dict[str, float]:
    """`retrieval_metrics` on the MPN-refined embeddings (both protocols), plus the mean number of
    k-reciprocal neighbours per query (`reciprocal_neighbours`)."""
    q = as_float32_matrix(query_emb, "query_emb")
    r = q if reference_emb is None else as_float32_matrix(reference_emb, "reference_emb")
    idx, valid = reciprocal_neighbours(q, r, k, leave_one_out=reference_emb is None, device=device)
    refined_q, refined_r = refine(mpn, q, r, idx, valid, device=device), None
    if reference_emb is not None:
        refined_r = refine(mpn, r, r, *reciprocal_neighbours(r, r, k, leave_one_out=True, device=device),
                           device=device)
    metrics = retrieval_metrics(refined_q, query_labels, refined_r, reference_labels, ks=ks,
                                chunk_size=chunk_size, device=device, nmi=nmi)
    metrics["reciprocal_neighbours"] = float(valid.sum(axis=1).mean()) if valid.size else 0.0
    return metrics
