"""Exact k-nearest-neighbour search by inner product on the CPU, at the speed of the matrix products.

Three steps per query (`search`):
1. A first pass keeps w = k + m candidates by blocks of matrix products: bfloat16 where this CPU multiplies
   bf16 fast (`xbn.utils.cpu.bf16_gemm_is_fast`, ~4x float32 on AVX512-BF16), else float32. Leave-one-out on
   one set takes the symmetric path: each block above the diagonal serves its rows and its columns, half the
   products.
2. The candidates are re-scored by one routine, the float32 rounding of a float64 dot product (`rescore`), and
   ordered by (score descending, index ascending). This score is what "exact" means here: both first passes,
   and every fallback, end in it, so their results are identical; a GEMM's float32 values would depend on its
   kernel and block shape and could swap two neighbours one ulp apart.
3. The query is certified when its k-th re-scored score is strictly above the largest score any
   non-candidate can have (`_slack`: how much too low its first-pass score can be). The others are searched
   again in float32 (from bf16), and what is still uncertified (many equal scores across the k + m boundary,
   e.g. exact duplicates) is scored against every reference (`_exhaustive`).

Memory is O(N·w + block²) and never N².
"""

from __future__ import annotations

import numpy as np
import torch

from xbn.utils.cpu import bf16_gemm_is_fast

BF16_UNIT = 2.0**-8  # unit roundoff of bfloat16: 8 significant bits (7 stored), round to nearest even
FP32_UNIT = 2.0**-24
SAFETY = 1.25  # the bound is rigorous for the arithmetic it models; a quarter more for what it does not
GROUP = 16  # rows whose column maxima are compared first: an exact filter reads 1/16 of each block
SORT_ROWS = 8192  # queries whose candidates are ordered at once (`rescore`)
RESCORE_BATCH = 1024  # candidates re-scored at once: gathered, they stay in the cache (measured: 4x fewer, or
# more, cost up to 2x at w = 200)


def extra_candidates(k: int, dtype: torch.dtype) -> int:
    """m, the candidates kept beyond k. The bf16 bound (~0.005 + 0.005|c| on SOP-like embeddings, d = 512)
    spans many ranks of a large set's similarities, the more the deeper k goes: measured on 60k clustered unit
    vectors, m = 16 leaves 0.03% of queries uncertified at k = 7, m = 64 1% and m = 96 none at k = 100; so
    m = k, at least 16. The float32 bound (~4e-5) spans a rank or two: m = 8 (16 cost 5% more time at 60k, in
    the merges and the re-scoring, which grow with k + m)."""
    return max(16, k) if dtype == torch.bfloat16 else 8


def search(q: np.ndarray, r: np.ndarray, k: int, *, exclude: np.ndarray | None, symmetric: bool, block: int,
           stats: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(similarities float32 [Nq, k], indices int64 [Nq, k]) of the k references with the highest re-scored
    inner product, ties by lower index; `exclude[i]` is left out of query i's references; `symmetric`:
    leave-one-out with `q is r` (exclude = own index). `stats` receives the path and the fallback counts."""
    nq = len(q)
    available = len(r) - int(symmetric or exclude is not None)
    dtype = torch.bfloat16 if bf16_gemm_is_fast() else torch.float32
    sims = np.empty((nq, k), dtype=np.float32)
    idx = np.empty((nq, k), dtype=np.int64)
    if symmetric:
        exclude = np.arange(nq)
    q_norms = norms(q)
    r_max = (q_norms if r is q else norms(r)).max(axis=0)
    todo = np.arange(nq)
    uncertified = []  # after each pass: the queries it could not certify
    # A user's torch.set_float32_matmul_precision("medium") would let float32 products run in bf16, outside
    # the float32 bound.
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.no_grad():
            for level in dict.fromkeys([dtype, torch.float32]):
                w = min(k + extra_candidates(k, level), available)
                if symmetric and len(todo) == nq:
                    values, first = _self_pass(q, w, level, block)
                else:
                    sub = None if exclude is None else exclude[todo]
                    values, first = _cross_pass(q[todo], r, w, level, block, sub)
                # the w-th first-pass value caps every non-candidate's first-pass value
                cap = values[:, -1].double().numpy()
                del values  # [N, w]: freed before the re-scoring allocates its own
                scores, cand = rescore(q[todo], r, first, keep=k)
                rel, abs_ = _slack(level, q_norms[todo], r_max, q.shape[1])
                limit = cap + rel * np.abs(cap) + abs_
                ok = np.full(len(todo), w == available) | (scores[:, k - 1].astype(np.float64) > limit)
                sims[todo[ok]], idx[todo[ok]] = scores[ok, :k], cand[ok, :k]
                todo = todo[~ok]
                uncertified.append(len(todo))
                if not len(todo):
                    break
            if len(todo):
                sub = None if exclude is None else exclude[todo]
                sims[todo], idx[todo] = _exhaustive(q[todo], r, k, sub)
    finally:
        torch.set_float32_matmul_precision(precision)
    if stats is not None:
        stats.update({"path": str(dtype).removeprefix("torch."), "queries": nq,
                      "candidates": min(k + extra_candidates(k, dtype), available),
                      # not certified by the first pass: searched again in float32 (bf16 path) or against
                      # every reference (float32 path); `exhaustive_queries`: against every reference
                      "fallback_queries": uncertified[0], "exhaustive_queries": len(todo)})
    return sims, idx


def _slack(dtype: torch.dtype, q_norms: np.ndarray, r_max: np.ndarray, dim: int) -> tuple[float, np.ndarray]:
    """(rel, abs [Nq]) from the queries' `norms` and their maxima over the references, such that every
    reference j outside query i's candidates has a re-scored score t_j ≤ c + rel·|c| + abs_i, c being the w-th
    candidate's first-pass score (c_j ≤ c).

    Derivation, for vectors of dimension d, u = 2^-8 (bf16), u32 = 2^-24, γ = d·u32 / (1 - d·u32), q̃ = bf16(q),
    δq = q̃ - q (componentwise |δq_l| ≤ u|q_l|, so ‖δq‖ ≤ u‖q‖), the same for r:
    - inputs: q̃·r̃ - q·r = δq·r̃ + q·δr, so |q̃·r̃ - q·r| ≤ ‖δq‖‖r̃‖ + ‖q‖‖δr‖ (Cauchy-Schwarz). For unit q, r the
      worst case is (2u + u²); the actual rounding errors are known (`norms`), and for typical embeddings
      ‖δq‖ ≈ 0.4u‖q‖, so the bound uses them (the largest ‖r̃_j‖, ‖δr_j‖ over the references).
    - Each product of two bf16 numbers is exact in float32 (8 + 8 significant bits ≤ 24); their float32 sum in
      any order (blocked, FMA) errs by at most γ Σ|q̃_l r̃_l| ≤ γ‖q̃‖‖r̃‖ (Higham, Accuracy and Stability of
      Numerical Algorithms, eq. 3.5). The float32 pass has exact inputs and rounded products: γ‖q‖‖r‖.
    - torch rounds the bf16 product's float32 result a to bf16: c = a(1 + δ), |δ| ≤ u, so a ≤ c + u|c|/(1 - u)
      for either sign of c; the bound increases with c, so c_j ≤ c carries over.
    - The re-scored score is the float64 dot (error ≤ d·2^-53‖q‖‖r‖ < 2^-40‖q‖‖r‖) rounded to float32 (≤ u32
      relative): |t - q·r| ≤ (u32 + 2^-40)‖q‖‖r‖.
    Unit vectors, d = 512, worst case: bf16 t_j ≤ c + 0.0039|c| + 0.0079, float32 t_j ≤ c + 3.1e-5. SAFETY
    multiplies both (for whatever a kernel does that this does not model), and
    AVX512-BF16 flushes subnormal products (each < 2^-126) to zero, so d·2^-120 is added whatever the norms."""
    u = BF16_UNIT
    gamma = dim * FP32_UNIT / (1 - dim * FP32_UNIT)
    norm, rounded, error = q_norms.T
    r_norm, r_rounded, r_error = r_max
    rescored = (FP32_UNIT + 2.0**-40) * norm * r_norm
    tiny = dim * 2.0**-120
    if dtype == torch.float32:
        return 0.0, SAFETY * (gamma * norm * r_norm + rescored) + tiny
    inputs = error * r_rounded + norm * r_error
    return SAFETY * u / (1 - u), SAFETY * (inputs + gamma * rounded * r_rounded + rescored) + tiny


def norms(x: np.ndarray) -> np.ndarray:
    """[N, 3]: per row ‖x‖, ‖x̃‖, ‖x̃ - x‖ with x̃ = bf16(x) as the first pass rounds it (x̃ - x is exact in
    float32: x̃ is within a factor 2 of x, Sterbenz). Computed in float32 by blocks, then enlarged by their own
    rounding bound (d·u32) so that they bound the true norms."""
    out = np.empty((len(x), 3))
    for a in range(0, len(x), 8192):
        rows = torch.from_numpy(x[a : a + 8192])
        rounded = rows.bfloat16().float()
        for i, v in enumerate((rows, rounded, rounded - rows)):
            out[a : a + 8192, i] = torch.linalg.vector_norm(v, dim=1).numpy()
    return out * (1 + x.shape[1] * FP32_UNIT)


def rescore(q: np.ndarray, r: np.ndarray, cand: torch.Tensor, keep: int | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
    """The re-scored similarities of candidates `cand` [Nq, w] and the candidates themselves, ordered per query
    by (score descending, index ascending), the first `keep` (default all w) of each. The ordering runs
    SORT_ROWS queries at a time, so its temporaries stay small next to the [Nq, w] candidates (at 120k queries
    and w = 200, sorting all at once added ~0.4 GB to the peak). The score is the float64 dot product (products of float32 numbers
    are exact in float64) rounded to float32: it depends on q and r alone, not on the batch or the kernel, up to
    float64 rounding, which can change the float32 only when the exact value lies within ~1e-13 of a float32
    rounding midpoint."""
    qt, rt = torch.from_numpy(q), torch.from_numpy(r)
    scores = torch.empty(cand.shape)
    rows = max(1, RESCORE_BATCH // cand.shape[1])
    # One thread: thousands of small parallel ops each wait for every thread, and on a machine shared with
    # other work one thread descheduled stalls them all (measured: 4.4 s on 2 threads vs 0.2 s on 1 under load,
    # 0.13 s vs 0.2 s idle).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for a in range(0, len(q), rows):
            b = min(a + rows, len(q))
            g = rt.index_select(0, cand[a:b].reshape(-1)).view(b - a, cand.shape[1], -1).double()
            scores[a:b] = g.mul_(qt[a:b, None, :].double()).sum(-1).float()
    finally:
        torch.set_num_threads(threads)
    keep = cand.shape[1] if keep is None else keep
    out_scores = np.empty((len(q), keep), dtype=np.float32)
    out_cand = np.empty((len(q), keep), dtype=np.int64)
    for a in range(0, len(q), SORT_ROWS):
        b = min(a + SORT_ROWS, len(q))
        c, at = torch.sort(cand[a:b], dim=1)  # index ascending, then a stable sort by score keeps it among ties
        sc, at = torch.sort(torch.gather(scores[a:b], 1, at), dim=1, descending=True, stable=True)
        out_scores[a:b], out_cand[a:b] = sc[:, :keep], torch.gather(c, 1, at[:, :keep])
    return out_scores, out_cand


def _exhaustive(q: np.ndarray, r: np.ndarray, k: int, exclude: np.ndarray | None
                ) -> tuple[np.ndarray, np.ndarray]:
    """The last resort, for the queries that no candidate set certifies: every reference re-scored as
    `rescore` does (float64, rounded to float32), sorted with ties by index."""
    r64 = torch.from_numpy(r).double()
    sims = np.empty((len(q), k), dtype=np.float32)
    idx = np.empty((len(q), k), dtype=np.int64)
    rows = max(1, 2**25 // len(r))  # ~256 MB of float64 scores at a time
    for a in range(0, len(q), rows):
        b = min(a + rows, len(q))
        s = (torch.from_numpy(q[a:b]).double() @ r64.T).float()
        if exclude is not None:
            own = torch.from_numpy(exclude[a:b])
            inside = (own >= 0) & (own < len(r))
            s[torch.arange(b - a)[inside], own[inside]] = -torch.inf
        top, at = torch.sort(s, dim=1, descending=True, stable=True)
        sims[a:b], idx[a:b] = top[:, :k].numpy(), at[:, :k].numpy()
    return sims, idx


class _Blocks:
    """Products of row blocks in `dtype` as float32 views of reused buffers (a fresh 64 MB result per block
    costs page faults: glibc maps allocations this large anew each time), rows padded with -inf to a multiple
    of GROUP for `_update`."""

    def __init__(self, dtype: torch.dtype, block: int):
        size = -(-block // GROUP) * GROUP * block
        self.out = torch.empty(size, dtype=dtype)
        self.f32 = self.out if dtype == torch.float32 else torch.empty(size)

    def product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        rows = -(-len(a) // GROUP) * GROUP
        out = self.out[: rows * len(b)].view(rows, len(b))
        torch.matmul(a, b.T, out=out[: len(a)])
        # bf16 comparisons and reductions are slow on the CPU: one exact conversion, then float32
        s = self.f32[: out.numel()].view(out.shape).copy_(out) if out.dtype != torch.float32 else out
        s[len(a) :] = -torch.inf
        return s


def _self_pass(x: np.ndarray, w: int, dtype: torch.dtype, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first-pass top-w of every row of `x` among the others (own row left out by index), by blocks of the
    upper triangle of x·xᵀ. Diagonal blocks first fill every row's top-w with a plain top-w; after that a
    block (I, J), J > I, feeds the entries above a row's current w-th best to rows I and, transposed, to rows J.
    Returns (first-pass values float32 [N, w] descending, indices)."""
    n = len(x)
    xt = torch.from_numpy(x).to(dtype)
    values = torch.full((n, w), -torch.inf)
    idx = torch.zeros((n, w), dtype=torch.long)
    blocks = _Blocks(dtype, block)
    starts = range(0, n, block)
    for i0 in starts:
        i1 = min(i0 + block, n)
        s = blocks.product(xt[i0:i1], xt[i0:i1])[: i1 - i0]
        s.fill_diagonal_(-torch.inf)
        top, at = torch.topk(s, min(w, i1 - i0), dim=1)
        values[i0:i1, : top.shape[1]], idx[i0:i1, : top.shape[1]] = top, at + i0
    for i0 in starts:
        i1 = min(i0 + block, n)
        for j0 in range(i0 + block, n, block):
            j1 = min(j0 + block, n)
            _update(values, idx, blocks.product(xt[i0:i1], xt[j0:j1]), i0, j0, columns=True)
    return values, idx


def _cross_pass(q: np.ndarray, r: np.ndarray, w: int, dtype: torch.dtype, block: int,
                exclude: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first-pass top-w of each query among the references, `exclude[i]` left out of query i's; the first
    reference block by a plain top-w, the others through `_update`. Returns (values float32 [Nq, w], indices)."""
    qt, rt = torch.from_numpy(q).to(dtype), torch.from_numpy(r).to(dtype)
    values = torch.full((len(q), w), -torch.inf)
    idx = torch.zeros((len(q), w), dtype=torch.long)
    blocks = _Blocks(dtype, block)
    own = None if exclude is None else torch.from_numpy(exclude)
    for i0 in range(0, len(q), block):
        i1 = min(i0 + block, len(q))
        for j0 in range(0, len(r), block):
            j1 = min(j0 + block, len(r))
            s = blocks.product(qt[i0:i1], rt[j0:j1])
            if own is not None:
                rows = torch.nonzero((own[i0:i1] >= j0) & (own[i0:i1] < j1)).ravel()
                s[rows, own[i0:i1][rows] - j0] = -torch.inf
            if j0 == 0:
                top, at = torch.topk(s[: i1 - i0], min(w, j1), dim=1)
                values[i0:i1, : top.shape[1]], idx[i0:i1, : top.shape[1]] = top, at
            else:
                _update(values, idx, s, i0, j0, columns=False)
    return values, idx


def _update(values, idx, s, i0: int, j0: int, columns: bool) -> None:
    """Merge block s (rows i0..., padded to GROUP; columns j0...) into the running top-w of its rows, and with
    `columns` of its columns (s transposed: the symmetric pass). Only entries above the current w-th best enter,
    and those are few: the maxima of each column over GROUP rows are compared first (one read of s, a 16x
    smaller compare), then only the flagged cells' GROUP entries."""
    n = min(len(s), len(values) - i0)
    row_floor = torch.full((len(s),), torch.inf)  # padding rows take nothing
    row_floor[:n] = values[i0 : i0 + n, -1]
    cells = s.view(-1, GROUP, s.shape[1])
    group_floor = row_floor.view(-1, GROUP)
    lo = group_floor.amin(1)[:, None]
    if columns:  # rows J: the merge of rows I below leaves their floors as they are
        col_floor = values[j0 : j0 + s.shape[1], -1]
        lo = torch.minimum(lo, col_floor)
    g, c = torch.nonzero(cells.amax(1) > lo, as_tuple=True)
    flagged = cells[g, :, c]  # [cells, GROUP]
    rows = g[:, None] * GROUP + torch.arange(GROUP)
    at, t = torch.nonzero(flagged > group_floor[g], as_tuple=True)
    queries, found, new = [rows[at, t] + i0], [c[at] + j0], [flagged[at, t]]
    if columns:
        at, t = torch.nonzero(flagged > col_floor[c, None], as_tuple=True)
        queries.append(c[at] + j0)
        found.append(rows[at, t] + i0)
        new.append(flagged[at, t])
    q_all, found_all, new_all = torch.cat(queries), torch.cat(found), torch.cat(new)
    order = torch.argsort(q_all)
    _merge(values, idx, q_all[order], found_all[order], new_all[order])


def _merge(values, idx, rows, columns, new) -> None:
    """Merge candidates (query `rows` grouped, their neighbour `columns` and values `new`)
    into the running top-w (values, idx: descending per row) with one top-w over [touched rows, w + most
    candidates]."""
    if not len(rows):
        return
    w = values.shape[1]
    touched, counts = torch.unique_consecutive(rows, return_counts=True)
    slot = torch.repeat_interleave(torch.arange(len(touched)), counts)
    position = torch.arange(len(rows)) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    width = w + int(counts.max())
    pool_v = torch.full((len(touched), width), -torch.inf)
    pool_i = torch.zeros((len(touched), width), dtype=torch.long)
    pool_v[:, :w], pool_i[:, :w] = values[touched], idx[touched]
    pool_v[slot, w + position], pool_i[slot, w + position] = new, columns
    top, at = torch.topk(pool_v, w, dim=1)
    values[touched], idx[touched] = top, torch.gather(pool_i, 1, at)
