"""Data-parallel helpers over `torch.distributed`: who this process is, the process group's lifetime, the
collectives the training loop needs, and the `torchrun` launcher behind `xbn train --nproc N` (one machine) and
`xbn train --nnodes N --node-rank R --rdzv-endpoint HOST:PORT` (several, through torchrun's c10d rendezvous).

Everything here is a no-op in a single process (no group initialised), so the same code runs both ways.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

# Rank 0 validates and writes checkpoints while the other ranks wait in a collective; NCCL's default of 10
# minutes would abort a long validation.
TIMEOUT = timedelta(minutes=60)


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def local_rank() -> int:
    """This process's index on its machine (torchrun's LOCAL_RANK): the GPU it owns."""
    return int(os.environ.get("LOCAL_RANK", "0"))


@contextlib.contextmanager
def process_group(device_type: str) -> Iterator[None]:
    """Under torchrun (WORLD_SIZE > 1) initialise the default group from its environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), NCCL for CUDA and gloo for the CPU, and destroy it on the way out."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        yield
        return
    if device_type == "cuda":
        torch.cuda.set_device(local_rank())  # NCCL collectives and broadcast_object_list use the current GPU
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=TIMEOUT)
    try:
        yield
    finally:
        dist.destroy_process_group()


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def broadcast_from_main(obj: T | None) -> T:
    """Rank 0's `obj` on every rank (a picklable object; the other ranks pass None): decisions taken on rank 0
    reach all ranks."""
    if world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        obj = box[0]
    assert obj is not None, "rank 0 broadcast None"
    return obj


def gather_objects(obj: T) -> list[T]:
    """Every rank's `obj` (picklable), in rank order, on every rank: `[obj]` in a single process."""
    if world_size() == 1:
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor` concatenated along dim 0 in rank order (rank 0's rows first on every rank), so
    all ranks hold the same global batch. This rank's slot is `tensor` itself, so autograd reaches its own
    rows; the other slots are detached copies (all_gather has no gradient). All ranks pass the same shape."""
    size = world_size()
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.detach().contiguous())
    parts[rank()] = tensor
    return torch.cat(parts)


def average_gradients(parameters: Sequence[torch.Tensor]) -> None:
    """Replace each gradient of `parameters` by its mean over the ranks (one all-reduce of them flattened);
    for parameters outside the DistributedDataParallel module, whose gradients DDP does not reduce. Every
    rank must pass the same parameters with gradients of the same shapes."""
    size = world_size()
    grads = [p.grad for p in parameters if p.grad is not None]
    if size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= size
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def scale_grad(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """`tensor` unchanged in the forward pass, its gradient multiplied by `factor` in the backward pass."""
    return _ScaleGrad.apply(tensor, factor)


@dataclass(frozen=True)
class Nodes:
    """The machines of a multi-node run: `count` of them, this one's index `rank`, and torchrun's c10d
    rendezvous at `endpoint` (HOST:PORT), which node 0 hosts; `run_id` names the job there (every node passes
    the same)."""

    count: int
    rank: int
    endpoint: str
    run_id: str


def parse_endpoint(text: str) -> tuple[str, int]:
    """(host, port) of `HOST:PORT` (`[v6-address]:PORT` too); ValueError saying what is wrong."""
    host, sep, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT with a port from 1 to 65535 (e.g. 10.0.0.1:29400)")
    return host, int(port)


def torchrun_command(nproc: int, module: str, args: Sequence[str], nodes: Nodes | None = None) -> list[str]:
    """`python -m torch.distributed.run ... --nproc-per-node N -m module args...`, the workers' RANK/LOCAL_RANK/
    WORLD_SIZE in their environment. One machine: `--standalone` (a free local port chosen by torchrun).
    Several: the c10d rendezvous at `nodes.endpoint`, whose store node 0 hosts (`is_host`: no guessing from the
    endpoint's name, which fails behind an alias and races when every node is 127.0.0.1). torchrun numbers the
    nodes itself under c10d (it ignores --node-rank), so the global rank 0 that writes may be on any node."""
    head = [sys.executable, "-m", "torch.distributed.run"]
    if nodes is None:
        head.append("--standalone")
    else:
        head += [f"--nnodes={nodes.count}", "--rdzv-backend=c10d", f"--rdzv-endpoint={nodes.endpoint}",
                 f"--rdzv-id={nodes.run_id}", f"--rdzv-conf=is_host={str(nodes.rank == 0).lower()}"]
    return [*head, f"--nproc-per-node={nproc}", "-m", module, *args]


def launch(nproc: int, module: str, args: Sequence[str], nodes: Nodes | None = None) -> int:
    """Run `module` in `nproc` processes (on each of `nodes`) with torchrun and return its exit status
    (non-zero if any worker failed; torchrun then stops the others)."""
    return subprocess.run(torchrun_command(nproc, module, args, nodes), check=False).returncode
