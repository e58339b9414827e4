"""Gated Multi-head Latent Attention (MLA) without positional encoding (NoPE), as in K3's full-attention layers.

Keys and values are decoded from a small per-token latent (``kv_lora_rank`` + a shared ``qk_rope_head_dim``
key part), so the decoding cache holds only that latent; a sigmoid gate scales the attention output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from policy.config import K3Config
from policy.layers import RMSNorm


@dataclass
class LatentCache:
    """Per-layer MLA cache: latents (B, S, kv_lora_rank + rope_dim) and which slots are real (B, S)."""

    latent: torch.Tensor
    valid: torch.Tensor

    def nbytes(self) -> int:
        return self.latent.numel() * self.latent.element_size()


# the q and kv latents' RMSNorm epsilon: fixed, not rms_norm_eps, in both references (mlx-lm, transformers)
LATENT_NORM_EPS = 1e-6


class GatedMLA(nn.Module):
    """Low-rank q and kv projections, NoPE attention over the latent cache, sigmoid output gate."""

    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.H, self.nope, self.rope, self.vdim = H, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * (self.nope + self.rope), bias=False)
        self.kv_a_proj = nn.Linear(D, self.rank + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, H * (self.nope + self.vdim), bias=False)
        self.g_proj = nn.Linear(D, H * self.vdim, bias=False) if cfg.mla_use_output_gate else None
        self.o_proj = nn.Linear(H * self.vdim, D, bias=False)

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """The per-token latent that the cache stores: normalised kv latent and the shared key part."""
        c, k_pe = self.kv_a_proj(x).split([self.rank, self.rope], dim=-1)
        return torch.cat([self.kv_a_norm(c), k_pe], dim=-1)

    def forward(self, x: torch.Tensor, cache: LatentCache | None = None) -> tuple[torch.Tensor, LatentCache]:
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))).view(B, T, self.H, -1).transpose(1, 2)
        new = LatentCache(self.latent(x), torch.ones(B, T, dtype=torch.bool, device=x.device))
        if cache is not None:
            new = LatentCache(torch.cat([cache.latent, new.latent], 1), torch.cat([cache.valid, new.valid], 1))
        S = new.latent.shape[1]
        c, k_pe = new.latent.split([self.rank, self.rope], dim=-1)
        kv = self.kv_b_proj(c).view(B, S, self.H, self.nope + self.vdim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.vdim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(B, self.H, S, self.rope)], dim=-1)
        # query j (absolute slot S-T+j) sees valid slots up to itself; NoPE, so no positions are needed
        causal = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)
        mask = (causal[None] & new.valid[:, None, :]).unsqueeze(1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        o = o.transpose(1, 2).reshape(B, T, self.H * self.vdim)
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o), new
