"""How to apply XBN's map (Eq. 6) at the cost of XBM (issue 44 item 3): the candidates, measured before choosing.

    python -m benchmarks map_variants [--sizes 4096 65536] [--batches 16 64] [--rounds 100] [--quick]

A memory step's work that depends on the memory is the map (XBN only) and the loss's similarity of the batch
to every row, forward and backward through the batch (the rows are detached). The cosine similarity normalises
each row, so a map cannot just be folded into the query: the norm of a mapped row a * r + b is
sqrt(r^2 . a^2 + 2 r . ab + |b|^2), which needs the squares of every row. Six ways, timed on the same batch
and rows, interleaved round by round (the first variant rotating), process CPU time, one torch thread:

  xbm          pytorch-metric-learning's `CosineSimilarity` of the batch to the stored rows (today's XBM)
  xbn_eager    the map in place as one fused pass over the rows (`torch.addcmul(shift, rows, scale,
               out=rows)`, today's XBN), then the same similarity
  xbn_lazy     the rows kept as written with one composed affine, folded into the similarity: the numerator
               is one matrix product of [q * a; 2ab] with the raw rows, the norms one product of the rows'
               squares (kept beside the rows: M x d more memory) with a^2
  xbm_folded   the same fold for XBM (a = 1, b = 0): a product with the raw rows over norms cached at enqueue,
               without PML's normalised copy of the memory; the fair reference for xbn_lazy
  xbm_blocked  PML's normalised copy made a block of `BLOCK` rows at a time (each block read from memory once,
               normalised while in cache), then the same product
  xbn_blocked  the rows kept as written, the composed affine applied to each block in cache on its way into
               the normalised copy: no pass of its own over the memory; the fair reference is xbm_blocked

Each variant's similarity is checked against `xbm`'s on the same mapped rows (max abs difference recorded). The
ratios are per round, as median with its 95% bootstrap interval (`verdicts.median_interval`). Writes
benchmarks/results/map_variants.json (map_variants_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from pytorch_metric_learning.distances import CosineSimilarity

from benchmarks.common import write_result
from benchmarks.verdicts import median_interval

VARIANTS = ("xbm", "xbn_eager", "xbn_lazy", "xbm_folded", "xbm_blocked", "xbn_blocked")
RATIOS = (("xbn_eager", "xbm"), ("xbn_lazy", "xbm"), ("xbn_lazy", "xbm_folded"), ("xbm_folded", "xbm"),
          ("xbn_blocked", "xbm_blocked"), ("xbn_blocked", "xbm"), ("xbm_blocked", "xbm"))
BLOCK = 1024  # rows: 2 MB at d = 512, in the L2/L3 of the CPUs measured


class Setting:
    """One memory (M x d unit rows), one batch (B x d), one per-step affine near the identity (as XBN's is
    between two steps), and each variant's step as a callable returning the similarity matrix."""

    def __init__(self, size: int, batch: int, dim: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.rows = F.normalize(torch.randn(size, dim, generator=g), dim=1)
        self.eager_rows = self.rows.clone()
        self.squares = self.rows * self.rows
        self.norms = self.rows.norm(dim=1)
        self.query = F.normalize(torch.randn(batch, dim, generator=g), dim=1)
        self.weights = torch.randn(batch, size, generator=g)  # the loss's gradient w.r.t. the similarities
        self.scale = 1 + 0.001 * torch.randn(dim, generator=g)
        self.shift = 0.001 * torch.randn(dim, generator=g)
        self.cosine = CosineSimilarity()
        self.flip = False

    def _backward(self, similarity: torch.Tensor) -> torch.Tensor:
        (similarity * self.weights).sum().backward()
        return similarity.detach()

    def xbm(self) -> torch.Tensor:
        return self._backward(self.cosine(self.query.requires_grad_(), self.rows))

    def xbn_eager(self) -> torch.Tensor:
        # alternate the map and its inverse: the rows stay where they were, round after round
        scale, shift = (1 / self.scale, -self.shift / self.scale) if self.flip else (self.scale, self.shift)
        self.flip = not self.flip
        torch.addcmul(shift, self.eager_rows, scale, out=self.eager_rows)
        return self._backward(self.cosine(self.query.requires_grad_(), self.eager_rows))

    def xbn_lazy(self, scale: torch.Tensor | None = None, shift: torch.Tensor | None = None) -> torch.Tensor:
        a = self.scale if scale is None else scale
        b = self.shift if shift is None else shift
        q = F.normalize(self.query.requires_grad_(), dim=1)
        folded = torch.cat([q * a, (2 * a * b)[None]]) @ self.rows.T  # [B + 1, M]: one pass over the rows
        norms = (self.squares @ (a * a) + folded[-1].detach() + (b * b).sum()).clamp_min(1e-24).sqrt()
        return self._backward((folded[:-1] + (q @ b)[:, None]) / norms)

    def xbm_folded(self) -> torch.Tensor:
        q = F.normalize(self.query.requires_grad_(), dim=1)
        return self._backward((q @ self.rows.T) / self.norms)

    def _normalised(self, scale: torch.Tensor | None = None, shift: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(self.rows)
        for rows, block in zip(self.rows.split(BLOCK), out.split(BLOCK)):
            if scale is None:
                torch.div(rows, torch.linalg.vector_norm(rows, dim=1, keepdim=True).clamp_min_(1e-12), out=block)
            else:
                torch.addcmul(shift, rows, scale, out=block)
                block.div_(torch.linalg.vector_norm(block, dim=1, keepdim=True).clamp_min_(1e-12))
        return out

    def xbm_blocked(self) -> torch.Tensor:
        q = F.normalize(self.query.requires_grad_(), dim=1)
        return self._backward(q @ self._normalised().T)

    def xbn_blocked(self) -> torch.Tensor:
        q = F.normalize(self.query.requires_grad_(), dim=1)
        return self._backward(q @ self._normalised(self.scale, self.shift).T)

    def parity(self) -> dict[str, float]:
        """Each variant's similarity against PML's cosine of the same (mapped) rows."""
        mapped = torch.addcmul(self.shift, self.rows, self.scale)
        reference, plain = self.cosine(self.query, mapped).detach(), self.cosine(self.query, self.rows).detach()
        lazy, folded = self.xbn_lazy(), self.xbm_folded()
        blocked, xbm_blocked = self.xbn_blocked(), self.xbm_blocked()
        self.query.grad = None
        return {"xbn_lazy": float((lazy - reference).abs().max()), "xbm_folded": float((folded - plain).abs().max()),
                "xbn_blocked": float((blocked - reference).abs().max()),
                "xbm_blocked": float((xbm_blocked - plain).abs().max())}


def measure(size: int, batch: int, dim: int, rounds: int, warmup: int) -> dict:
    setting = Setting(size, batch, dim)
    parity = setting.parity()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(warmup + rounds):
        order = VARIANTS[i % len(VARIANTS):] + VARIANTS[: i % len(VARIANTS)]
        for name in order:
            setting.query.grad = None
            start = time.process_time()
            getattr(setting, name)()
            if i >= warmup:
                times[name].append(time.process_time() - start)
    return {
        "memory_size": size, "batch": batch, "dim": dim, "rounds": rounds,
        "ms": {v: round(1000 * median_interval(t)["median"], 4) for v, t in times.items()},
        "ratio": {f"{a}/{b}": median_interval([x / y for x, y in zip(times[a], times[b])]) for a, b in RATIOS},
        "max_abs_difference": parity,
        "extra_memory_mb": {"xbn_lazy": round(size * dim * 4 / 2**20, 1), "xbm_folded": round(size * 4 / 2**20, 3)},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 65536])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="M = 1024, 10 rounds: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.batches, args.rounds, args.warmup = [1024], [16], 10, 1
    torch.set_num_threads(1)
    rows = []
    for size in args.sizes:
        for batch in args.batches:
            row = measure(size, batch, args.dim, args.rounds, args.warmup)
            rows.append(row)
            shown = "  ".join(f"{k} {v['median']:.3f} [{v['low']:.3f}, {v['high']:.3f}]" for k, v in row["ratio"].items())
            print(f"M={size:>6} B={batch:>3}  {shown}", flush=True)
    result = {"benchmark": "XBN's map: eager fused pass vs a lazy affine folded into the similarity (issue 44)",
              "device": "cpu", "threads": 1, "rows": rows}
    path = write_result("map_variants_quick" if args.quick else "map_variants", result)
    print(f"wrote {path}")
    return result


def render(data: dict) -> str:
    """The section's table and the choice it supports, from the results alone."""
    from benchmarks.common import markdown_table

    rows = data["rows"]
    table = [[r["memory_size"], r["batch"], *[f"{r['ratio'][f'{a}/{b}']['median']} [{r['ratio'][f'{a}/{b}']['low']}, "
                                              f"{r['ratio'][f'{a}/{b}']['high']}]" for a, b in RATIOS]] for r in rows]
    best = []
    for r in rows:
        # XBN's candidates, each against the XBM it should be compared with (the same similarity work)
        judged = {"eager": r["ratio"]["xbn_eager/xbm"], "lazy": r["ratio"]["xbn_lazy/xbm_folded"],
                  "blocked": r["ratio"]["xbn_blocked/xbm_blocked"]}
        name, ratio = min(judged.items(), key=lambda kv: kv[1]["high"])
        best.append(f"M = {r['memory_size']}, B = {r['batch']}: {name} ({ratio['median']} [{ratio['low']}, "
                    f"{ratio['high']}] of its XBM)")
    return "\n".join([
        "Each ratio is per round, median [95% bootstrap interval]; `max_abs_difference` of every variant's "
        "similarities to PML's on the same rows was at most "
        f"{max(v for r in rows for v in r['max_abs_difference'].values()):.2g}.", "",
        markdown_table(["M", "B", *[f"{a} / {b}" for a, b in RATIOS]], table), "",
        "Lowest upper bound of XBN's cost over the XBM doing the same similarity work, per setting: "
        + "; ".join(best) + ".", ""])
