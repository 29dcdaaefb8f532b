"""Neighbourhood-context refinement (seed 001, Kim et al.): a second-stage model on frozen embeddings.

Each embedding z attends to its context C, the k nearest neighbours of z in the reference set (z itself
excluded), through T cross-attention blocks that add residual updates (Eq. 3), each followed by an L2
normalisation (Algorithms 1 and 2):

    z_{t+1} = normalize(z_t + softmax((z_t W_q)(C W_k)^T / sqrt(d_h)) (C W_v) W_o)   (per head, concatenated)

The context stays the frozen reference embeddings in every block; only z moves. Every embedding is refined
this way, queries and references alike (Algorithm 2), and retrieval compares refined with refined. The output
projection starts at zero, so an untrained refiner is the identity on unit vectors: training starts from the
plain embedding's ranking and can only be selected over it on validation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from xbn.utils.io import save_torch

REFINER_FORMAT = "xbn-refiner/1"


class ContextBlock(nn.Module):
    """One residual cross-attention block of Eq. 3: queries from the embedding, keys/values from the context."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"heads ({heads}) must divide the embedding dimension ({dim})")
        # W_q, W_k, W_v and W_o (with biases) of Eq. 3; W_o starts at zero: the block starts as the identity.
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        nn.init.zeros_(self.attention.out_proj.weight)
        nn.init.zeros_(self.attention.out_proj.bias)

    def forward(self, z: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """z [B, d], context [B, k, d] -> z + attention update [B, d]."""
        update, _ = self.attention(z.unsqueeze(1), context, context, need_weights=False)
        return z + update.squeeze(1)


class ContextRefiner(nn.Module):
    """T `ContextBlock`s, each followed by L2 normalisation (Algorithms 1/2: the next block's attention and the
    loss compare unit vectors)."""

    def __init__(self, dim: int, blocks: int = 8, heads: int = 4) -> None:
        super().__init__()
        self.dim, self.heads = dim, heads
        self.blocks = nn.ModuleList(ContextBlock(dim, heads) for _ in range(blocks))

    def forward(self, z: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            z = F.normalize(block(z, context), dim=-1)
        return z

    @torch.no_grad()
    def refine(self, z: torch.Tensor, references: torch.Tensor, neighbours: torch.Tensor,
               chunk_size: int = 4096) -> torch.Tensor:
        """Refine each row of `z` [N, d] against `references[neighbours[i]]` ([N, k] indices), in chunks."""
        was_training = self.training
        self.eval()
        out = [self(z[s:s + chunk_size], references[neighbours[s:s + chunk_size]])
               for s in range(0, len(z), chunk_size)]
        self.train(was_training)
        return torch.cat(out) if out else z.new_empty((0, self.dim))


def save_refiner(path: str | Path, refiner: ContextRefiner | None, extra: dict[str, Any]) -> None:
    """Write the refiner (or, with None, a 'disabled' marker) atomically, loadable with weights_only=True."""
    checkpoint: dict[str, Any] = {"format": REFINER_FORMAT, "enabled": refiner is not None, **extra}
    if refiner is not None:
        checkpoint.update(dim=refiner.dim, blocks=len(refiner.blocks), heads=refiner.heads,
                          state_dict={k: v.detach().cpu() for k, v in refiner.state_dict().items()})
    save_torch(path, checkpoint)


def load_refiner(path: str | Path, map_location: str | torch.device = "cpu"
                 ) -> tuple[ContextRefiner | None, dict[str, Any]]:
    """(refiner in eval mode, or None for a 'disabled' marker; the whole checkpoint dict)."""
    checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    found = checkpoint.get("format") if isinstance(checkpoint, dict) else type(checkpoint).__name__
    if found != REFINER_FORMAT:
        raise ValueError(f"{path} is not an xbn refiner: format {found!r}, expected {REFINER_FORMAT!r}")
    if not checkpoint["enabled"]:
        return None, checkpoint
    refiner = ContextRefiner(checkpoint["dim"], checkpoint["blocks"], checkpoint["heads"])
    refiner.load_state_dict(checkpoint["state_dict"])
    return refiner.to(map_location).eval(), checkpoint
