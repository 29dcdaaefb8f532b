"""Data-parallel helpers over `torch.distributed`: who this process is, the process group's lifetime, the
collectives the training loop needs, and the `torchrun` launcher behind `xbn train --nproc N`.

Everything here is a no-op in a single process (no group initialised), so the same code runs both ways.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
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


def broadcast_from_main(obj: T) -> T:
    """Rank 0's `obj` on every rank (a picklable object): decisions taken on rank 0 reach all ranks."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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


def torchrun_command(nproc: int, module: str, args: Sequence[str]) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc-per-node N -m module args...`: one machine, a
    free rendezvous port chosen by torchrun, the workers' RANK/LOCAL_RANK/WORLD_SIZE in their environment."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", module, *args]


def launch(nproc: int, module: str, args: Sequence[str]) -> int:
    """Run `module` in `nproc` processes with torchrun and return its exit status (non-zero if any worker
    failed; torchrun then stops the others)."""
    return subprocess.run(torchrun_command(nproc, module, args), check=False).returncode
