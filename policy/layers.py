"""Small building blocks shared by the K3 parts: RMSNorm, the gated RMSNorm, SiTU and its MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with a learned per-channel scale."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class GatedRMSNorm(RMSNorm):
    """RMSNorm whose output is multiplied by ``sigmoid(gate)`` (KDA's output normalisation)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        assert gate is not None
        return super().forward(x) * torch.sigmoid(gate)


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """K3's SiTU activation: ``beta·tanh(g/beta)·sigmoid(g) · lb·tanh(u/lb)`` (soft-capped SwiGLU)."""
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (linear_beta * torch.tanh(up / linear_beta))


class SiTUMLP(nn.Module):
    """A gated MLP with the SiTU activation (dense first layer and shared experts)."""

    def __init__(self, dim: int, hidden: int, beta: float = 4.0, linear_beta: float = 25.0) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.beta, self.linear_beta = beta, linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Normalise the last dimension to unit L2 norm."""
    return F.normalize(x, p=2.0, dim=-1, eps=eps)
