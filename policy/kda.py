"""Kimi Delta Attention (KDA): a gated delta-rule linear attention with a fixed-size state.

Per head, with per-channel decay ``alpha_t = exp(g_t)``:
    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t
``kda_recurrent`` runs that loop token by token (decoding); ``kda_chunked`` computes the same
thing a chunk at a time with a triangular solve (prefill and training).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from policy.config import K3Config
from policy.layers import GatedRMSNorm, l2norm


def kda_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float, state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA. q, k, g: (B,T,H,K); v: (B,T,H,V); beta: (B,T,H); state: (B,H,K,V)."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if state is None else state
    outs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)                                     # Diag(alpha_t) S
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)                          # + k u^T
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
    return torch.stack(outs, dim=1), S


def kda_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    scale: float, state: torch.Tensor | None = None, chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel KDA, equal to ``kda_recurrent``.

    Within a chunk, S_t = Diag(e^{G_t}) S_0 + sum_{i<=t} Diag(e^{G_t-G_i}) k_i u_i^T with G the
    cumulative log-decay; the pseudo-values u solve (I + diag(beta) A_kk) U = diag(beta)(V - K_g S_0).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    pad = (-T) % C
    if pad:  # zero k, beta and decay leave the state untouched
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n = q.shape[1] // C
    # (B, H, n, C, dim)
    q, k, v, g = (x.reshape(B, n, C, H, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v, g))
    beta = beta.reshape(B, n, C, H).permute(0, 3, 1, 2)
    q = q * scale
    G = g.cumsum(dim=-2)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = causal.clone().fill_diagonal_(False)
    # e^{G_t - G_i} for i <= t, per channel: (B, H, n, C, C, K); masked entries never exponentiate
    diff = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~causal[:, :, None], float("-inf")).exp()
    A_kk = torch.einsum("bhntk,bhnik,bhntik->bhnti", k, k, diff).masked_fill(~strict, 0)
    A_qk = torch.einsum("bhntk,bhnik,bhntik->bhnti", q, k, diff)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    T_mat = eye + beta.unsqueeze(-1) * A_kk
    S = q.new_zeros(B, H, K, V) if state is None else state
    outs = []
    for c in range(n):
        Gc = G[:, :, c]
        rhs = beta[:, :, c, :, None] * (v[:, :, c] - torch.einsum("bhtk,bhkv->bhtv", k[:, :, c] * Gc.exp(), S))
        U = torch.linalg.solve_triangular(T_mat[:, :, c], rhs, upper=False, unitriangular=True)
        outs.append(torch.einsum("bhtk,bhkv->bhtv", q[:, :, c] * Gc.exp(), S) + A_qk[:, :, c] @ U)
        decay_to_end = (Gc[:, :, -1:] - Gc).exp()                                # e^{G_C - G_i}
        S = S * Gc[:, :, -1].exp().unsqueeze(-1) + torch.einsum("bhik,bhiv->bhkv", k[:, :, c] * decay_to_end, U)
    o = torch.stack(outs, dim=2).permute(0, 2, 3, 1, 4).reshape(B, n * C, H, V)
    return o[:, :T], S


def _fla_chunk_kda():  # pragma: no cover - only on CUDA with flash-linear-attention installed
    try:
        from fla.ops.kda import chunk_kda
    except Exception:
        return None
    return chunk_kda


class ShortConv(nn.Module):
    """Depthwise causal convolution followed by SiLU; its state is the last ``kernel-1`` inputs."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.randn(channels, kernel) / kernel)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, Ch = x.shape
        prev = x.new_zeros(B, Ch, self.kernel - 1) if state is None else state
        xx = torch.cat([prev, x.transpose(1, 2)], dim=-1)
        y = F.conv1d(xx, self.weight.unsqueeze(1), groups=Ch)
        return F.silu(y.transpose(1, 2)), xx[..., xx.shape[-1] - (self.kernel - 1):]


@dataclass
class KDAState:
    """Fixed-size per-layer decoding state: three conv tails and the (B,H,K,V) delta-rule state."""

    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    recurrent: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_q, self.conv_k, self.conv_v, self.recurrent))


class KimiDeltaAttention(nn.Module):
    """The KDA layer: projections, short convs, L2-normalised q/k, K3's lower-bounded gate, gated RMSNorm."""

    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        D, H, K = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim
        self.H, self.K, self.V = H, K, K
        self.lower_bound = cfg.gate_lower_bound
        self.chunk_size = cfg.kda_chunk_size
        self.mode = "auto"  # "auto" | "chunk" | "recurrent"
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * self.V, bias=False)
        self.q_conv = ShortConv(H * K, cfg.short_conv_kernel_size)
        self.k_conv = ShortConv(H * K, cfg.short_conv_kernel_size)
        self.v_conv = ShortConv(H * self.V, cfg.short_conv_kernel_size)
        # the forget gate is low-rank (f_a_proj, f_b_proj); the output gate is full-rank with use_full_rank_gate
        # (K3) or low-rank (g_a_proj, g_b_proj: Kimi-Linear), as both references build them
        self.f_proj = nn.Sequential(nn.Linear(D, K, bias=False), nn.Linear(K, H * K, bias=False))
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(H * K))
        self.b_proj = nn.Linear(D, H, bias=False)
        self.g_proj: nn.Module = (nn.Linear(D, H * self.V, bias=False) if cfg.use_full_rank_gate else
                                  nn.Sequential(nn.Linear(D, self.V, bias=False), nn.Linear(self.V, H * self.V, bias=False)))
        self.o_norm = GatedRMSNorm(self.V, eps=cfg.rms_norm_eps)
        self.o_proj = nn.Linear(H * self.V, D, bias=False)

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        """Log-decay per head and channel: ``lower_bound · sigmoid(exp(A_log) · (f + dt_bias))`` (K3), or
        ``-exp(A_log) · softplus(f + dt_bias)`` without a lower bound (Kimi-Linear)."""
        f = (self.f_proj(x) + self.dt_bias).unflatten(-1, (self.H, self.K))
        if self.lower_bound is None:
            return -self.A_log.exp()[:, None] * F.softplus(f)
        return self.lower_bound * torch.sigmoid(self.A_log.exp()[:, None] * f)

    def forward(self, x: torch.Tensor, state: KDAState | None = None) -> tuple[torch.Tensor, KDAState]:
        B, T, _ = x.shape
        q, cq = self.q_conv(self.q_proj(x), state.conv_q if state else None)
        k, ck = self.k_conv(self.k_proj(x), state.conv_k if state else None)
        v, cv = self.v_conv(self.v_proj(x), state.conv_v if state else None)
        q, k = l2norm(q.unflatten(-1, (self.H, self.K))), l2norm(k.unflatten(-1, (self.H, self.K)))
        v = v.unflatten(-1, (self.H, self.V))
        g, beta = self.gate(x), torch.sigmoid(self.b_proj(x))
        S0 = state.recurrent if state else None
        scale = self.K ** -0.5
        use_recurrent = self.mode == "recurrent" or (self.mode == "auto" and T <= 2)
        fla = _fla_chunk_kda() if x.is_cuda and not use_recurrent else None
        o = None
        if fla is not None:  # pragma: no cover - the fused GPU kernel, when its signature matches
            try:
                o, S = fla(q, k, v, g, beta, scale=scale, initial_state=S0, output_final_state=True)
            except TypeError:
                o = None
        if o is not None:
            pass
        elif use_recurrent:
            o, S = kda_recurrent(q, k, v, g, beta, scale, S0)
        else:
            o, S = kda_chunked(q, k, v, g, beta, scale, S0, self.chunk_size)
        gate = self.g_proj(x).unflatten(-1, (self.H, self.V))
        o = self.o_norm(o, gate).flatten(-2)
        return self.o_proj(o), KDAState(cq, ck, cv, S)
