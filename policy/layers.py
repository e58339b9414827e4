"""Small building blocks shared by the K3 parts: RMSNorm, the gated RMSNorm, SiTU (or SwiGLU) and its MLP."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from policy.config import K3Config


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


Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def gated_activation(cfg: K3Config) -> Activation:
    """Every MLP's ``(gate, up) -> hidden`` for ``cfg.hidden_act``: K3's SiTU, or SwiGLU (Kimi-Linear's "silu")."""
    if cfg.hidden_act == "silu":
        return lambda gate, up: F.silu(gate) * up
    return partial(situ, beta=cfg.activation_situ_beta, linear_beta=cfg.activation_situ_linear_beta)


class SiTUMLP(nn.Module):
    """A gated MLP (dense layers and shared experts) with the model's activation (SiTU in K3)."""

    def __init__(self, dim: int, hidden: int, act: Activation) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Normalise the last dimension to unit L2 norm."""
    return F.normalize(x, p=2.0, dim=-1, eps=eps)
