"""The K3 model: embedding, a dense first layer, then layers at K3's 3:1 KDA:MLA pattern with LatentMoE,
all joined by Attention Residuals; ``forward`` takes and returns a decoding cache for incremental decoding."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from policy.attnres import BlockAttnRes, DepthStream
from policy.config import K3Config
from policy.ep import EPGroup
from policy.kda import KDAState, KimiDeltaAttention
from policy.layers import RMSNorm, SiTUMLP, gated_activation
from policy.mla import GatedMLA, LatentCache
from policy.moe import LatentMoE

LayerCache = KDAState | LatentCache


@dataclass
class Cache:
    """Decoding state of a batch: one entry per layer (KDA: fixed-size state; MLA: growing latent cache)."""

    layers: list[LayerCache]

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers)

    def copy(self) -> Cache:
        """An independent cache to continue from. The layers never write into cache tensors (every forward
        builds new ones), so the copy shares them with the original until either one moves on."""
        return Cache(list(self.layers))

    @staticmethod
    def stack(caches: list[Cache]) -> Cache:
        """Join single-sequence caches into one batch; MLA latents are left-padded and masked (NoPE)."""
        out: list[LayerCache] = []
        for parts in zip(*(c.layers for c in caches), strict=True):
            if isinstance(parts[0], KDAState):
                kp = [p for p in parts if isinstance(p, KDAState)]
                out.append(KDAState(*(torch.cat([getattr(p, f) for p in kp]) for f in
                                      ("conv_q", "conv_k", "conv_v", "recurrent"))))
            else:
                lp = [p for p in parts if isinstance(p, LatentCache)]
                S = max(p.latent.shape[1] for p in lp)
                out.append(LatentCache(
                    torch.cat([F.pad(p.latent, (0, 0, S - p.latent.shape[1], 0)) for p in lp]),
                    torch.cat([F.pad(p.valid, (S - p.valid.shape[1], 0), value=False) for p in lp])))
        return Cache(out)

    def unstack(self) -> list[Cache]:
        """Split a batch cache back into single-sequence caches (dropping padding)."""
        per_layer: list[list[LayerCache]] = []
        for c in self.layers:
            if isinstance(c, KDAState):
                per_layer.append([KDAState(*t) for t in zip(c.conv_q.split(1), c.conv_k.split(1),
                                                             c.conv_v.split(1), c.recurrent.split(1), strict=True)])
            else:
                per_layer.append([LatentCache(lat[:, v[0]], v[:, v[0]]) for lat, v in
                                  zip(c.latent.split(1), c.valid.split(1), strict=True)])
        return [Cache(list(layers)) for layers in zip(*per_layer, strict=True)]


class DecoderLayer(nn.Module):
    """Attention (KDA or gated MLA) and MLP (dense or LatentMoE), each reading the stream through AttnRes."""

    def __init__(self, cfg: K3Config, layer_idx: int, ep: EPGroup | None = None) -> None:
        super().__init__()
        D = cfg.hidden_size
        self.kind = cfg.layer_kind(layer_idx)
        self.attn: nn.Module = KimiDeltaAttention(cfg) if self.kind == "kda" else GatedMLA(cfg)
        self.mlp: nn.Module = (SiTUMLP(D, cfg.intermediate_size, gated_activation(cfg))
                               if cfg.is_dense(layer_idx) else LatentMoE(cfg, ep))
        self.attn_norm, self.mlp_norm = RMSNorm(D, cfg.rms_norm_eps), RMSNorm(D, cfg.rms_norm_eps)
        res = cfg.attn_res_block_size is not None
        self.attn_res = BlockAttnRes(D, cfg.rms_norm_eps) if res else None
        self.mlp_res = BlockAttnRes(D, cfg.rms_norm_eps) if res else None

    def forward(self, stream: DepthStream, cache: LayerCache | None) -> LayerCache:
        out, new_cache = self.attn(self.attn_norm(stream.read(self.attn_res)), cache)
        stream.add(out)
        stream.add(self.mlp(self.mlp_norm(stream.read(self.mlp_res))))
        return new_cache


class K3Model(nn.Module):
    """Kimi-K3-architecture causal LM; with ``ep`` set, this rank holds only its shard of routed experts."""

    def __init__(self, cfg: K3Config, ep: EPGroup | None = None) -> None:
        super().__init__()
        self.cfg, self.ep = cfg.validate(), ep
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, ep) for i in range(cfg.num_hidden_layers))
        self.final_res = BlockAttnRes(cfg.hidden_size, cfg.rms_norm_eps) if cfg.attn_res_block_size else None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if not any(p.is_meta for p in self.parameters()):
            self.apply(_init_weights)

    def forward(self, input_ids: torch.Tensor, cache: Cache | None = None) -> tuple[torch.Tensor, Cache]:
        """Logits (B, T, vocab) for ``input_ids`` (B, T) continuing ``cache``; returns the updated cache."""
        block = self.cfg.attn_res_block_size
        stream = DepthStream(self.embed_tokens(input_ids), 2 * block if block else None)
        new = [layer(stream, cache.layers[i] if cache else None) for i, layer in enumerate(self.layers)]
        return self.lm_head(self.norm(stream.read(self.final_res))), Cache(new)

    def moe_layers(self) -> list[LatentMoE]:
        return [m for m in self.modules() if isinstance(m, LatentMoE)]

    def last_routing(self, batch: int, tokens: int) -> torch.Tensor:
        """The experts of the last forward (``batch`` x ``tokens``) as (batch, tokens, MoE layers, k) global ids."""
        moes = self.moe_layers()
        if not moes:
            return torch.zeros(batch, tokens, 0, 0, dtype=torch.long)
        return torch.stack([m.last_routing for m in moes], dim=1).view(batch, tokens, len(moes), moes[0].router.k)

    def idle_step(self) -> None:
        """Join one forward's expert all-to-alls with no tokens (an EP rank with nothing to run this round)."""
        for moe in self.moe_layers():
            moe(self.embed_tokens.weight.new_zeros(0, self.cfg.hidden_size))


def _init_weights(m: nn.Module) -> None:
    if isinstance(m, nn.Linear | nn.Embedding):
        nn.init.normal_(m.weight, std=0.02)


def param_counts(model: K3Model) -> dict[str, int]:
    """Total parameters, and active ones per token (routed experts count only ``k/E`` of themselves)."""
    cfg = model.cfg
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for m in model.moe_layers() for p in m.experts.parameters())
    world = model.ep.world if model.ep else 1
    routed_full = routed * world
    total_full = total - routed + routed_full
    active = total_full - routed_full + routed_full * cfg.num_experts_per_token // cfg.num_experts
    return {"total": total_full, "active": active, "routed_experts": routed_full}
