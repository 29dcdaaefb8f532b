"""The message-passing network of Intra-Batch (Seidenschwarz, Elezi, Leal-Taixé, "Learning Intra-Batch
Connections for Deep Metric Learning", ICML 2021, Sec. 3.2).

Every sample of a batch is a node of a fully connected graph; each of the L steps updates every node from all
nodes with multi-head dot-product attention (M heads, each d/M wide, concatenated and projected; Eq. 2-3),
then residual + LayerNorm, a two-layer feed-forward block, residual + LayerNorm (Eq. 4). That is exactly a
post-norm `nn.TransformerEncoderLayer` with ReLU and no positional encoding, so the layer is taken from torch;
the authors' code puts dropout at the same three places (attention weights, after attention, inside and after
the feed-forward block). Without positions the network is permutation equivariant over the batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from xbn.utils.io import save_torch

MPN_FORMAT = "xbn-mpn/1"


class MessagePassingNetwork(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, ffn_multiplier: int = 4, dropout: float = 0.1):
        super().__init__()
        if dim % heads:
            raise ValueError(f"embedding dim {dim} is not divisible by {heads} heads")
        self.config = {"dim": dim, "layers": layers, "heads": heads, "ffn_multiplier": ffn_multiplier,
                       "dropout": dropout}
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, ffn_multiplier * dim, dropout, activation="relu",
                                       batch_first=True, norm_first=False)
            for _ in range(layers))

    def forward(self, nodes: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`nodes` [n, d] (one graph: the batch) or [B, n, d] (B graphs); `padding_mask` [B, n] is True
        where a node is padding (graphs of different sizes). Returns the refined node features, same shape."""
        single = nodes.dim() == 2
        x = nodes.unsqueeze(0) if single else nodes
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=padding_mask)
        return x.squeeze(0) if single else x


def save_mpn(path: str | Path, mpn: MessagePassingNetwork | None) -> None:
    """Write the trained MPN (plain types and tensors, for torch.load(weights_only=True)). Without an MPN a
    'disabled' marker is written, so the file the pipeline tracks always exists."""
    state: dict[str, Any] = {"format": MPN_FORMAT, "enabled": mpn is not None}
    if mpn is not None:
        state["config"] = dict(mpn.config)
        state["state_dict"] = {k: v.detach().cpu() for k, v in mpn.state_dict().items()}
    save_torch(path, state)


def load_mpn(path: str | Path, map_location: str | torch.device = "cpu") -> MessagePassingNetwork:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no trained MPN at {path}: train with model.mpn.enabled=true first")
    state = torch.load(path, map_location=map_location, weights_only=True)
    if not isinstance(state, dict) or state.get("format") != MPN_FORMAT:
        raise ValueError(f"{path} is not an xbn MPN file (expected format {MPN_FORMAT!r})")
    if not state["enabled"]:
        raise ValueError(f"{path} holds no MPN: the model was trained with model.mpn.enabled=false")
    mpn = MessagePassingNetwork(**state["config"])
    mpn.load_state_dict(state["state_dict"])
    return mpn.to(map_location).eval()
