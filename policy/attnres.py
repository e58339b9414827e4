"""Attention Residuals (Block AttnRes): each sub-layer reads the residual stream through a learned softmax
over sealed block snapshots (block 0 is the token embedding) plus the running sum of the current block."""

from __future__ import annotations

import torch
from torch import nn

from policy.layers import RMSNorm


class BlockAttnRes(nn.Module):
    """One learned pseudo-query ``w``: ``h = sum_i softmax_i(w · RMSNorm(v_i)) v_i`` over depth sources."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(dim))  # zero init: a uniform average of the sources
        self.norm = RMSNorm(dim, eps)

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        V = torch.stack(sources, dim=0)
        weights = torch.softmax((self.norm(V) * self.query).sum(-1), dim=0)
        return (weights.unsqueeze(-1) * V).sum(0)


class DepthStream:
    """The residual stream across depth: sealed block sums plus the partial sum of the open block.

    ``block_size`` counts sub-layers (attention and MLP each count one): twice K3's ``attn_res_block_size``, which
    counts decoder layers. ``None`` (AttnRes off): one plain running sum, the embedding included.
    """

    def __init__(self, embedding: torch.Tensor, block_size: int | None) -> None:
        self.blocks: list[torch.Tensor] = [embedding] if block_size else []
        self.partial: torch.Tensor | None = None if block_size else embedding
        self.block_size = block_size
        self.count = 0

    def read(self, res: BlockAttnRes | None) -> torch.Tensor:
        """What the next sub-layer reads: ``res`` over the sources, or the plain sum when AttnRes is off."""
        return self.sources()[0] if res is None else res(self.sources())

    def sources(self) -> list[torch.Tensor]:
        return self.blocks + ([self.partial] if self.partial is not None else [])

    def add(self, out: torch.Tensor) -> None:
        """Add one sub-layer's output to the open block; seal it every ``block_size`` sub-layers."""
        self.partial = out if self.partial is None else self.partial + out
        self.count += 1
        if self.block_size and self.count % self.block_size == 0:
            self.blocks.append(self.partial)
            self.partial = None
