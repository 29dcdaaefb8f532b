"""Memory adaptation overhead: time per training step spent in loss + memory update, per memory method.

    python -m benchmarks.memory_bench [--sizes 1024 16384 65536] [--batches 16 64] [--device cpu|cuda]

Synthetic unit-norm embeddings (d = 512, `batch // 4` classes of 4), no backbone. Each step is a forward and
backward of SupCon with a pair-margin miner against a full memory. The methods are measured round-robin
(one step of each in turn), so machine noise falls on all of them alike, and reported as the median step time
and its ratio to `xbm` measured in the same run. `pml` is pytorch-metric-learning's `CrossBatchMemory` used
directly (the XBM everyone has), `none` the same loss on the minibatch alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from pytorch_metric_learning import losses, miners

from benchmarks.common import machine_info, write_result
from xbn.config import load_params
from xbn.memory import AdaptiveCrossBatchMemory, Criterion, build_moments

METHODS = ("none", "pml", "xbm", "xbn", "axbn", "ema")


def build(method: str, size: int, dim: int, device: torch.device):
    loss, miner = losses.SupConLoss(temperature=0.1), miners.PairMarginMiner(0.2, 0.8)
    if method == "none":
        return Criterion(loss, miner)
    if method == "pml":
        memory = losses.CrossBatchMemory(loss, dim, memory_size=size, miner=miner)
    else:
        params = load_params(None, [f"memory.method={method}", f"model.embedding_dim={dim}"])
        memory = AdaptiveCrossBatchMemory(loss, dim, size, miner=miner, moments=build_moments(params))
    memory.to(device)
    g = torch.Generator().manual_seed(0)
    memory.embedding_memory.copy_(torch.nn.functional.normalize(torch.randn(size, dim, generator=g), dim=1))
    memory.label_memory.copy_(torch.randint(0, size // 4, (size,), generator=g))
    memory.has_been_filled = True
    if isinstance(memory, AdaptiveCrossBatchMemory):
        memory.refresh_sums()
    return memory


def step(module, embeddings: torch.Tensor, labels: torch.Tensor, device: torch.device) -> float:
    embeddings = embeddings.detach().requires_grad_()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    module(embeddings, labels).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(size: int, batch: int, dim: int, steps: int, warmup: int, device: torch.device) -> dict:
    modules = {m: build(m, size, dim, device) for m in METHODS}
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    g = torch.Generator().manual_seed(1)
    for i in range(warmup + steps):
        x = torch.nn.functional.normalize(torch.randn(batch, dim, generator=g), dim=1).to(device)
        y = (torch.arange(batch) // 4 + 10_000 * (i + 1)).to(device)  # new classes each step, like a real stream
        for method, module in modules.items():
            t = step(module, x, y, device)
            if i >= warmup:
                times[method].append(t)
    medians = {m: statistics.median(v) * 1000 for m, v in times.items()}
    return {
        "memory_size": size, "batch": batch, "dim": dim, "steps": steps, "device": str(device),
        "ms_per_step": {m: round(v, 3) for m, v in medians.items()},
        "ratio_to_xbm": {m: round(v / medians["xbm"], 4) for m, v in medians.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 16384, 65536])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--name", default=None, help="results file name (default memory_<device>)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for size in args.sizes:
        for batch in args.batches:
            row = measure(size, batch, args.dim, args.steps, args.warmup, device)
            rows.append(row)
            ratios = "  ".join(f"{m} {row['ratio_to_xbm'][m]:.3f}" for m in METHODS)
            print(f"M={size:>6} B={batch:>3}  xbm {row['ms_per_step']['xbm']:8.2f} ms  ratio: {ratios}", flush=True)
    info = machine_info(("torch", "pytorch-metric-learning"))
    info["threads"] = torch.get_num_threads()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    path = write_result(args.name or f"memory_{device.type}", {
        "command": "python -m benchmarks.memory_bench " + " ".join(argv or []), "machine": info, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
