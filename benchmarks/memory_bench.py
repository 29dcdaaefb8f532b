"""Memory adaptation overhead: time per training step spent in loss + memory update, per memory method.

    python -m benchmarks memory [--quick] [--sizes 1024 16384 65536] [--batches 16 64] [--device cpu|cuda]
                                [--threads 1] [--steps 12] [--big-steps 8]

Synthetic unit-norm embeddings (d = 512, `batch // 4` classes of 4), no backbone. Each step is a forward and
backward of SupCon with a pair-margin miner against a full memory. The methods (none, pml, xbm, xbn, axbn,
axbn_auto, ema) are measured round-robin, one step of each in turn with the starting method rotating every
step, so machine noise falls on all of them alike; reported as median step times and their ratio to `xbm`
measured in the same run, both in wall time and (CPU) in process CPU time, which a descheduled process does not
accumulate. `pml` is pytorch-metric-learning's `CrossBatchMemory` used directly (the XBM everyone has), `none`
the same loss on the minibatch alone. Writes benchmarks/results/memory_<device>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from pytorch_metric_learning import losses, miners

from benchmarks.common import machine_info, write_result
from xbn.config import load_params
from xbn.memory import CrossBatchMemory
from xbn.training.criterion import Criterion, build_moments

METHODS = ("none", "pml", "xbm", "xbn", "axbn", "axbn_auto", "ema")


def build(method: str, size: int, dim: int, device: torch.device):
    loss, miner = losses.SupConLoss(temperature=0.1), miners.PairMarginMiner(0.2, 0.8)
    if method == "none":
        return Criterion(loss, miner)
    if method == "pml":
        memory = losses.CrossBatchMemory(loss, dim, memory_size=size, miner=miner)
    else:
        params = load_params(None, [f"memory.method={method}", f"model.embedding_dim={dim}"])
        memory = CrossBatchMemory(loss, dim, size, miner=miner, moments=build_moments(params))
    memory.to(device)
    g = torch.Generator().manual_seed(0)
    memory.embedding_memory.copy_(torch.nn.functional.normalize(torch.randn(size, dim, generator=g), dim=1))
    memory.label_memory.copy_(torch.randint(0, size // 4, (size,), generator=g))
    memory.has_been_filled = True
    if isinstance(memory, CrossBatchMemory):
        memory.refresh_sums()
    return memory


def step(module, embeddings: torch.Tensor, labels: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one forward + backward."""
    embeddings = embeddings.detach().requires_grad_()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start, start_cpu = time.perf_counter(), time.process_time()
    module(embeddings, labels).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - start_cpu


def measure(size: int, batch: int, dim: int, steps: int, warmup: int, device: torch.device,
            methods: tuple[str, ...] = METHODS) -> dict:
    modules = {m: build(m, size, dim, device) for m in methods}
    times: dict[str, list[float]] = {m: [] for m in methods}
    cpu_times: dict[str, list[float]] = {m: [] for m in methods}
    g = torch.Generator().manual_seed(1)
    load_before = os.getloadavg()
    for i in range(warmup + steps):
        x = torch.nn.functional.normalize(torch.randn(batch, dim, generator=g), dim=1).to(device)
        y = (torch.arange(batch) // 4 + 10_000 * (i + 1)).to(device)  # new classes each step, like a real stream
        # Round-robin, starting from a different method each step, so neither contention nor cache state
        # favours whichever method comes first.
        order = list(modules)[i % len(modules):] + list(modules)[: i % len(modules)]
        for method in order:
            t, c = step(modules[method], x, y, device)
            if i >= warmup:
                times[method].append(t)
                cpu_times[method].append(c)
    medians = {m: statistics.median(v) * 1000 for m, v in times.items()}
    cpu_medians = {m: statistics.median(v) * 1000 for m, v in cpu_times.items()}
    # Per-step ratio to the xbm step of the same round, then its median: a second estimate that cancels
    # contention that lasts about one round.
    paired = {m: statistics.median(a / b for a, b in zip(v, times["xbm"])) for m, v in times.items()}
    return {
        "memory_size": size, "batch": batch, "dim": dim, "steps": steps, "device": str(device),
        "loadavg_before": [round(v, 2) for v in load_before], "loadavg_after": [round(v, 2) for v in os.getloadavg()],
        "ms_per_step": {m: round(v, 3) for m, v in medians.items()},
        "ms_p25_p75": {m: [round(1000 * q, 3) for q in statistics.quantiles(v, n=4)[::2]] for m, v in times.items()},
        "ratio_to_xbm": {m: round(v / medians["xbm"], 4) for m, v in medians.items()},
        # On a CPU the process's CPU time (with --threads 1) is what the step costs, whatever share of the
        # cores the scheduler gave it: the steadier basis on a shared machine.
        "cpu_ms_per_step": {m: round(v, 3) for m, v in cpu_medians.items()},
        "cpu_ratio_to_xbm": {m: round(v / cpu_medians["xbm"], 4) for m, v in cpu_medians.items()},
        "paired_ratio_to_xbm": {m: round(v, 4) for m, v in paired.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 16384, 65536])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--big-steps", type=int, default=None, help="steps at M >= 65536 (default --steps)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default torch's); 1 is steadier on an oversubscribed machine")
    parser.add_argument("--quick", action="store_true", help="1k and 4k rows, 5 steps: a smoke run")
    parser.add_argument("--name", default=None, help="results file name (default memory_<device>)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.steps, args.warmup = [1024, 4096], 5, 1
        args.name = args.name or "memory_quick"
    if "xbm" not in args.methods:
        args.methods.append("xbm")  # the reference of every ratio
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for size in args.sizes:
        for batch in args.batches:
            steps = args.big_steps if args.big_steps and size >= 65536 else args.steps
            row = measure(size, batch, args.dim, steps, args.warmup, device, tuple(args.methods))
            rows.append(row)
            ratios = "  ".join(f"{m} {row['ratio_to_xbm'][m]:.3f}/{row['cpu_ratio_to_xbm'][m]:.3f}"
                               for m in args.methods)
            print(f"M={size:>6} B={batch:>3}  xbm {row['ms_per_step']['xbm']:8.2f} ms wall "
                  f"{row['cpu_ms_per_step']['xbm']:8.2f} ms CPU  ratio wall/CPU: {ratios}", flush=True)
    info = machine_info(("torch", "pytorch-metric-learning"))
    info["threads"] = torch.get_num_threads()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    path = write_result(args.name or f"memory_{device.type}", {
        "benchmark": "loss + memory update per training step, synthetic embeddings",
        "command": "python -m benchmarks memory " + " ".join(sys.argv[2:] if argv is None else argv),
        "machine": info, "target": "ratio to xbm <= 1.02 at 64k rows", "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
