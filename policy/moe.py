"""LatentMoE: K3's mixture of experts. A sigmoid router picks the top-k experts (its bias steers selection
only), the weights are renormalised and scaled; routed experts run in a down-projected latent width and
are projected back; shared experts see every token; all experts use SiTU."""

from __future__ import annotations

import torch
from torch import nn

from policy.config import K3Config
from policy.ep import EPGroup, dispatch_combine
from policy.layers import Activation, RMSNorm, SiTUMLP, gated_activation


class Router(nn.Module):
    """Sigmoid scores; ``scores + bias`` chooses the top-k, the unbiased scores weigh them."""

    e_score_correction_bias: torch.Tensor

    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        self.k, self.renormalize, self.scaling = cfg.num_experts_per_token, cfg.moe_renormalize, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.randn(cfg.num_experts, cfg.hidden_size) * cfg.hidden_size ** -0.5)
        # aux-loss-free balancing bias (noaux_tc): moved by the trainer after each step toward balance
        # (trainer/algorithm/balance.py, rl.router_bias_rate), never by gradients; a buffer, so it travels with the weights
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))

    def forward(self, x: torch.Tensor, forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts (N, k) and their weights; ``forced`` (N, k) replays given experts for the rows that have them
        (a row of -1 keeps the router's choice); their weights still come from the router's scores."""
        scores = torch.sigmoid(x @ self.weight.t())
        idx = torch.topk(scores + self.e_score_correction_bias, self.k, dim=-1).indices
        if forced is not None:
            idx = torch.where((forced >= 0).all(-1, keepdim=True), forced.to(idx), idx)
        w = scores.gather(-1, idx)
        if self.renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scaling


class GroupedExperts(nn.Module):
    """This rank's routed experts as stacked SiTU-MLP weights, applied to tokens grouped by expert."""

    def __init__(self, n_local: int, dim: int, hidden: int, act: Activation) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.randn(n_local, dim, hidden) * dim ** -0.5)
        self.w_up = nn.Parameter(torch.randn(n_local, dim, hidden) * dim ** -0.5)
        self.w_down = nn.Parameter(torch.randn(n_local, hidden, dim) * hidden ** -0.5)
        self.act = act

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, chunk in enumerate(tokens.split(counts.tolist())):
            if chunk.shape[0]:
                h = self.act(chunk @ self.w_gate[e], chunk @ self.w_up[e])
                outs.append(h @ self.w_down[e])
        if not outs:  # no token here: an empty result still tied to the weights, so that a backward pass runs
            # the same expert all-to-alls on this rank as on the ranks that did get tokens
            return self.act(tokens @ self.w_gate[0], tokens @ self.w_up[0]) @ self.w_down[0]
        return torch.cat(outs)


class LatentMoE(nn.Module):
    """Router + shared experts + routed experts in a latent width (down-project, experts, norm, up-project).

    Without ``routed_expert_hidden_size`` (Kimi-Linear) the routed experts run at the hidden width, with no
    projections and no norm. The norm (``latent_moe_use_norm``) applies to the weighted sum of the routed experts'
    outputs, before the up-projection, as mlx-lm's ``kimi_k3`` applies it."""

    def __init__(self, cfg: K3Config, ep: EPGroup | None = None) -> None:
        super().__init__()
        self.cfg, self.ep = cfg, ep
        D = cfg.hidden_size
        latent = cfg.routed_expert_hidden_size is not None
        L = cfg.routed_expert_hidden_size or D
        n_local = len((ep or EPGroup()).expert_range(cfg.num_experts))
        act = gated_activation(cfg)
        self.router = Router(cfg)
        self.shared_experts = (SiTUMLP(D, cfg.moe_intermediate_size * cfg.num_shared_experts, act)
                               if cfg.num_shared_experts else None)
        self.latent_down: nn.Module = nn.Linear(D, L, bias=False) if latent else nn.Identity()
        self.latent_norm: nn.Module = RMSNorm(L, cfg.rms_norm_eps) if latent and cfg.latent_moe_use_norm else nn.Identity()
        self.experts = GroupedExperts(n_local, L, cfg.moe_intermediate_size, act)
        self.latent_up: nn.Module = nn.Linear(L, D, bias=False) if latent else nn.Identity()
        self.tokens_per_expert = torch.zeros(n_local, dtype=torch.long)  # last step's load, for metrics
        self.last_routing = torch.zeros(0, cfg.num_experts_per_token, dtype=torch.long)  # (tokens, k) global ids
        self.replay: torch.Tensor | None = None  # routing replay: (tokens, k) experts the next forward must use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.replay is not None and self.replay.shape != (x.shape[0], self.router.k):
            raise ValueError(f"replayed routing has shape {tuple(self.replay.shape)}, the forward needs "
                             f"({x.shape[0]}, {self.router.k})")
        idx, w = self.router(x, self.replay)
        self.last_routing = idx.detach()  # the experts each token of the last forward was routed to
        y, counts = dispatch_combine(self.latent_down(x), idx, w, self.experts, self.cfg.num_experts, self.ep)
        self.tokens_per_expert = counts.detach().cpu()
        out = self.latent_up(self.latent_norm(y))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.reshape(shape)
