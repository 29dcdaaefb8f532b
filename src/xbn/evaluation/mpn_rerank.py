"""Intra-Batch at test time (Seidenschwarz et al., ICML 2021, Sec. 4 ablation): the trained MPN refines each
item's embedding over a graph of the item and its k-reciprocal neighbourhood, and retrieval is scored on the
refined embeddings.

The neighbourhood follows the paper, which follows Zhong et al.'s k-reciprocal re-ranking (CVPR 2017, Eq. 4-6)
as the authors' `KReciprocalSampler` does:

1. N(i, k): i and its k nearest neighbours; R(i, k) = {j in N(i, k) : i in N(j, k)}, the k-reciprocal set.
2. For every j in R(i, k): if |R(j, k/2) ∩ R(i, k)| >= 2/3 |R(j, k/2)|, R(j, k/2) joins (k/2 rounded as
   numpy rounds, half to even).
3. The expanded set, nearest to i first, is cut or padded with i's nearest neighbours not in it to a constant
   k_r nodes, the item included (`size`): every test graph has as many nodes as a training batch.

Leave-one-out: the references are the queries, and every item is refined over its neighbourhood among the
others. Query -> gallery: a query's N(q, k) is its k nearest gallery items, and q counts as in N(j, k) when it is
at least as similar to j as j's k-th nearest other gallery item (q added to the gallery, as Zhong et al. do);
the gallery items are refined over their own neighbourhoods in the gallery, so both sides live in the MPN's
output space.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from xbn.evaluation.knn import as_float32_matrix, knn_search
from xbn.evaluation.metrics import retrieval_metrics
from xbn.models.mpn import MessagePassingNetwork


def _reciprocal_sets(own: np.ndarray) -> list[np.ndarray]:
    """R(j, k) of every reference j, from `own` [n, k+1]: row j is j followed by its k nearest others."""
    sets: list[np.ndarray] = []
    for start in range(0, len(own), 4096):  # [chunk, k+1, k+1] at a time
        rows = own[start:start + 4096]
        mutual = (own[rows] == np.arange(start, start + len(rows))[:, None, None]).any(axis=2)  # j in N(a, k)
        sets.extend(row[m] for row, m in zip(rows, mutual))
    return sets


def kreciprocal_neighbourhoods(queries: np.ndarray, references: np.ndarray, k: int, size: int, *,
                               leave_one_out: bool, chunk_size: int = 4096, device: Any = "cpu"
                               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(indices [Nq, size-1] into references, valid [Nq, size-1], expanded [Nq]): each query's neighbourhood
    of `size` nodes less the query itself, in the paper's order (the expanded k-reciprocal set nearest first,
    then the padding); `valid` is False only where the references run out; `expanded` counts the expanded set
    (the query excluded). With `leave_one_out` the queries are the references."""
    n, width = len(references), size - 1
    others = min(max(k, width), n - 1)  # the nearest others searched once: the lists below and the padding
    ref_sims, ref_idx = knn_search(references, references, max(others, 1), exclude_self=True,
                                   chunk_size=chunk_size, device=device)
    ref_sims, ref_idx = ref_sims[:, :others], ref_idx[:, :others]
    k1, k2 = min(k, others), min(int(np.around(k / 2)), others)
    self_col = np.arange(n)[:, None]
    reciprocal = _reciprocal_sets(np.concatenate([self_col, ref_idx[:, :k1]], axis=1))
    half = _reciprocal_sets(np.concatenate([self_col, ref_idx[:, :k2]], axis=1))
    if leave_one_out:
        q_sets, q_nearest = reciprocal, ref_idx
    else:
        q_sims, q_nearest = knn_search(queries, references, max(others, 1), chunk_size=chunk_size, device=device)
        forward = q_nearest[:, :k1]
        # q in N(j, k) of the gallery with q added: q beats j's k-th nearest other gallery item.
        kth = ref_sims[:, k1 - 1] if k1 else np.full(n, -np.inf, np.float32)
        q_sets = [forward[i][q_sims[i, :k1] >= kth[forward[i]]] for i in range(len(queries))]
    idx = np.zeros((len(queries), width), np.int64)
    valid = np.zeros((len(queries), width), bool)
    expanded = np.zeros(len(queries), np.int64)
    for i, own in enumerate(q_sets):
        members = set(own.tolist())
        grown = set(members)
        for j in own:  # Zhong et al. Eq. 6: join R(j, k/2) when 2/3 of it already lies in R(i, k)
            candidate = half[j]
            if 3 * len(members.intersection(candidate.tolist())) >= 2 * len(candidate):
                grown.update(candidate.tolist())
        if leave_one_out:
            grown.discard(i)
        expanded[i] = len(grown)
        grown_idx = np.array(sorted(grown), np.int64)
        sims = references[grown_idx] @ queries[i] if len(grown_idx) else np.zeros(0, np.float32)
        chosen = grown_idx[np.argsort(-sims, kind="stable")][:width].tolist()
        taken = set(chosen)
        for j in q_nearest[i].tolist():  # pad with the nearest neighbours not in the set
            if len(chosen) >= width:
                break
            if j not in taken:
                chosen.append(j)
                taken.add(j)
        idx[i, :len(chosen)], valid[i, :len(chosen)] = chosen, True
    return idx, valid, expanded


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
                          reference_labels=None, *, k: int, size: int, ks=(1, 2, 4, 8), chunk_size: int = 4096,
                          device: Any = "cpu", nmi: bool = True) -> dict[str, float]:
    """`retrieval_metrics` on the MPN-refined embeddings (both protocols), plus the mean size of the queries'
    expanded k-reciprocal sets (`reciprocal_neighbours`, before the cut or padding to `size`)."""
    q = as_float32_matrix(query_emb, "query_emb")
    r = q if reference_emb is None else as_float32_matrix(reference_emb, "reference_emb")
    idx, valid, expanded = kreciprocal_neighbourhoods(q, r, k, size, leave_one_out=reference_emb is None,
                                                      device=device)
    refined_q, refined_r = refine(mpn, q, r, idx, valid, device=device), None
    if reference_emb is not None:
        r_idx, r_valid, _ = kreciprocal_neighbourhoods(r, r, k, size, leave_one_out=True, device=device)
        refined_r = refine(mpn, r, r, r_idx, r_valid, device=device)
    metrics = retrieval_metrics(refined_q, query_labels, refined_r, reference_labels, ks=ks,
                                chunk_size=chunk_size, device=device, nmi=nmi)
    metrics["reciprocal_neighbours"] = float(expanded.mean()) if len(expanded) else 0.0
    return metrics
