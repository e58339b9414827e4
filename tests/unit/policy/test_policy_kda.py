"""KDA against plain references written from the formulas (float64)."""

import torch
import torch.nn.functional as F

from policy.config import k3_mini
from policy.kda import KimiDeltaAttention, ShortConv, kda_chunked, kda_recurrent

torch.manual_seed(0)


def _inputs(B=2, T=37, H=3, K=8, V=6):
    q = torch.randn(B, T, H, K, dtype=torch.float64)
    k = F.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, dtype=torch.float64)
    g = -5 * torch.rand(B, T, H, K, dtype=torch.float64)
    beta = torch.rand(B, T, H, dtype=torch.float64)
    S0 = torch.randn(B, H, K, V, dtype=torch.float64)
    return q, k, v, g, beta, S0


def reference_kda(q, k, v, g, beta, scale, S0):
    """S_t = (I - b k k^T) Diag(exp g) S_{t-1} + b k v^T, o_t = S_t^T q_t, with explicit matrices."""
    B, T, H, K = q.shape
    o = torch.zeros(B, T, H, v.shape[-1], dtype=q.dtype)
    S_all = S0.clone()
    for b in range(B):
        for h in range(H):
            S = S0[b, h].clone()
            for t in range(T):
                kt = k[b, t, h][:, None]
                S = (torch.eye(K, dtype=q.dtype) - beta[b, t, h] * kt @ kt.T) @ torch.diag(g[b, t, h].exp()) @ S \
                    + beta[b, t, h] * kt @ v[b, t, h][None]
                o[b, t, h] = S.T @ (q[b, t, h] * scale)
            S_all[b, h] = S
    return o, S_all


def test_recurrent_matches_formula():
    q, k, v, g, beta, S0 = _inputs(T=9)
    o, S = kda_recurrent(q, k, v, g, beta, 0.5, S0)
    o_ref, S_ref = reference_kda(q, k, v, g, beta, 0.5, S0)
    torch.testing.assert_close(o, o_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(S, S_ref, atol=1e-10, rtol=0)


def test_chunked_matches_recurrent_float64():
    q, k, v, g, beta, S0 = _inputs()
    for chunk in (4, 8, 16, 64):
        o1, s1 = kda_recurrent(q, k, v, g, beta, 0.3, S0)
        o2, s2 = kda_chunked(q, k, v, g, beta, 0.3, S0, chunk)
        assert (o1 - o2).abs().max() < 1e-5 and (s1 - s2).abs().max() < 1e-5, chunk
    o3, _ = kda_chunked(q, k, v, g, beta, 0.3, None, 8)
    o4, _ = kda_recurrent(q, k, v, g, beta, 0.3, None)
    assert (o3 - o4).abs().max() < 1e-5


def test_short_conv_is_causal_depthwise_with_state():
    conv = ShortConv(5, 4).double()
    x = torch.randn(2, 11, 5, dtype=torch.float64)
    y, _ = conv(x, None)
    xp = F.pad(x, (0, 0, 3, 0))
    ref = torch.stack([sum(xp[:, t + j] * conv.weight[:, j] for j in range(4)) for t in range(11)], 1)
    torch.testing.assert_close(y, F.silu(ref))
    y1, st = conv(x[:, :6], None)
    y2, _ = conv(x[:, 6:], st)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y)


def test_gate_is_lower_bounded():
    cfg = k3_mini(vocab_size=64)
    layer = KimiDeltaAttention(cfg).double()
    with torch.no_grad():
        layer.A_log.fill_(2.0)
    x = 100 * torch.randn(3, 5, cfg.hidden_size, dtype=torch.float64)
    g = layer.gate(x)
    assert g.min() >= cfg.gate_lower_bound and g.max() <= 0
    f = layer.f_proj(x[0, 0]) + layer.dt_bias
    expected = cfg.gate_lower_bound * torch.sigmoid(layer.A_log.exp().repeat_interleave(layer.K) * f)
    torch.testing.assert_close(g[0, 0].flatten(), expected)


def test_layer_matches_reference_and_carries_state():
    cfg = k3_mini(vocab_size=64)
    layer = KimiDeltaAttention(cfg).double()
    with torch.no_grad():
        layer.o_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 13, cfg.hidden_size, dtype=torch.float64)
    out, state = layer(x)
    H, K = layer.H, layer.K
    q = F.normalize(layer.q_conv(layer.q_proj(x), None)[0].view(2, 13, H, K), dim=-1)
    k = F.normalize(layer.k_conv(layer.k_proj(x), None)[0].view(2, 13, H, K), dim=-1)
    v = layer.v_conv(layer.v_proj(x), None)[0].view(2, 13, H, K)
    g = cfg.gate_lower_bound * torch.sigmoid(layer.A_log.exp()[:, None] * (layer.f_proj(x) + layer.dt_bias).view(2, 13, H, K))
    beta = torch.sigmoid(layer.b_proj(x))
    o, _ = reference_kda(q, k, v, g, beta, K ** -0.5, torch.zeros(2, H, K, K, dtype=torch.float64))
    gate = layer.g_proj(x).view(2, 13, H, K)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * layer.o_norm.weight * torch.sigmoid(gate)
    torch.testing.assert_close(out, layer.o_proj(o.flatten(-2)), atol=1e-10, rtol=0)
    # the state is fixed-size and continuing from it equals the full pass
    out1, st = layer(x[:, :8])
    out2, st2 = layer(x[:, 8:], st)
    torch.testing.assert_close(torch.cat([out1, out2], 1), out, atol=1e-10, rtol=0)
    assert st.recurrent.shape == st2.recurrent.shape == (2, H, K, K)
