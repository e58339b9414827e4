"""Gated MLA, Attention Residuals and LatentMoE against plain references written from the formulas."""

import math

import torch

from policy.attnres import BlockAttnRes, DepthStream
from policy.config import k3_mini
from policy.layers import SiTUMLP, gated_activation, situ
from policy.mla import GatedMLA
from policy.moe import LatentMoE

torch.manual_seed(0)
CFG = k3_mini(vocab_size=64)


def test_mla_matches_reference_and_caches_latents_only():
    mla = GatedMLA(CFG).double()
    x = torch.randn(2, 9, CFG.hidden_size, dtype=torch.float64)
    out, cache = mla(x)
    H, dn, dr, dv, R = CFG.num_attention_heads, CFG.qk_nope_head_dim, CFG.qk_rope_head_dim, CFG.v_head_dim, CFG.kv_lora_rank
    ref = torch.zeros(2, 9, H * dv, dtype=torch.float64)
    for b in range(2):
        cq = mla.q_a_proj(x[b])
        cq = cq / torch.sqrt(cq.pow(2).mean(-1, keepdim=True) + 1e-6) * mla.q_a_norm.weight
        q = mla.q_b_proj(cq).view(9, H, dn + dr)
        ckv, kpe = mla.kv_a_proj(x[b]).split([R, dr], -1)
        ckv = ckv / torch.sqrt(ckv.pow(2).mean(-1, keepdim=True) + 1e-6) * mla.kv_a_norm.weight
        kv = mla.kv_b_proj(ckv).view(9, H, dn + dv)
        for h in range(H):
            k = torch.cat([kv[:, h, :dn], kpe], -1)
            s = q[:, h] @ k.T / math.sqrt(dn + dr)
            s = s.masked_fill(torch.ones(9, 9).triu(1).bool(), float("-inf"))
            ref[b, :, h * dv:(h + 1) * dv] = torch.softmax(s, -1) @ kv[:, h, dn:]
    ref = ref * torch.sigmoid(mla.g_proj(x))
    torch.testing.assert_close(out, mla.o_proj(ref), atol=1e-10, rtol=0)
    assert cache.latent.shape == (2, 9, R + dr)  # the cache is the latent, not per-head K/V


def test_attnres_softmax_over_sources():
    ar = BlockAttnRes(16).double()
    with torch.no_grad():
        ar.query.normal_()
    srcs = [torch.randn(3, 16, dtype=torch.float64) for _ in range(4)]
    logits = torch.stack([(s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * ar.query).sum(-1) for s in srcs])
    a = torch.softmax(logits, 0)
    torch.testing.assert_close(ar(srcs), sum(a[i, :, None] * srcs[i] for i in range(4)))
    with torch.no_grad():
        ar.query.zero_()
    torch.testing.assert_close(ar(srcs), torch.stack(srcs).mean(0))


def test_depth_stream_seals_blocks():
    st = DepthStream(torch.zeros(1), block_size=4)
    for i in range(9):
        st.add(torch.full((1,), float(i + 1)))
    assert [float(b) for b in st.blocks] == [0.0, 1 + 2 + 3 + 4, 5 + 6 + 7 + 8]
    assert st.partial is not None and float(st.partial) == 9.0
    assert len(st.sources()) == 4


def reference_moe(moe: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """Loop over tokens and their experts; the latent norm acts on the experts' weighted sum (mlx-lm's kimi_k3)."""
    cfg = moe.cfg
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        scores = torch.sigmoid(moe.router.weight @ x[n])
        chosen = sorted(range(cfg.num_experts), key=lambda e: -(scores[e] + moe.router.e_score_correction_bias[e]).item())
        chosen = chosen[:cfg.num_experts_per_token]
        w = scores[chosen] / scores[chosen].sum() * cfg.routed_scaling_factor
        z = moe.latent_down(x[n])
        y = torch.zeros_like(z)
        for we, e in zip(w, chosen, strict=True):
            ex = moe.experts
            h = situ(z @ ex.w_gate[e], z @ ex.w_up[e], cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
            y = y + we * (h @ ex.w_down[e])
        out[n] = moe.latent_up(moe.latent_norm(y)) + moe.shared_experts(x[n])
    return out


def test_situ_formula():
    g, u = torch.randn(50, dtype=torch.float64) * 20, torch.randn(50, dtype=torch.float64) * 60
    expected = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    torch.testing.assert_close(situ(g, u), expected)
    assert situ(g, u).abs().max() <= 4 * 25


def test_latent_moe_matches_loop_reference():
    moe = LatentMoE(CFG).double()
    with torch.no_grad():
        moe.router.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(11, CFG.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(moe(x), reference_moe(moe, x), atol=1e-10, rtol=0)
    assert int(moe.tokens_per_expert.sum()) == 11 * CFG.num_experts_per_token


def test_router_bias_selects_but_does_not_weigh():
    moe = LatentMoE(CFG).double()
    x = torch.randn(5, CFG.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        moe.router.e_score_correction_bias[7] = 100.0
    idx, w = moe.router(x)
    assert (idx == 7).any(-1).all()
    scores = torch.sigmoid(x @ moe.router.weight.T)
    torch.testing.assert_close(w, scores.gather(-1, idx) / scores.gather(-1, idx).sum(-1, keepdim=True))
    torch.testing.assert_close(w.sum(-1), torch.ones(5, dtype=torch.float64))


def test_dense_situ_mlp_matches_formula():
    mlp = SiTUMLP(CFG.hidden_size, CFG.intermediate_size, gated_activation(CFG)).double()
    x = torch.randn(3, CFG.hidden_size, dtype=torch.float64)
    g, u = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
    h = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    torch.testing.assert_close(mlp(x), h @ mlp.down_proj.weight.T)
