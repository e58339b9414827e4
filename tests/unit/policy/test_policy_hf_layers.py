"""The Kimi checkpoint format's agreement per layer type, per reference, on the same fp32 weights
(whole-model figures: test_policy_hf_format.py). The layer types: the first, dense layer (``first_k_dense_replace``;
KDA attention here), a KDA layer with MoE and an MLA layer with MoE; with K3's parts on, Attention Residuals' mixing
and LatentMoE are inside those layers.

Each reference layer is fed the same input as ours, the stream our forward holds before that layer, so a layer's
figure is its own and not what the layers before it left: for mlx-lm's ``kimi_k3``, AttnRes's sealed blocks and open
partial sum (its ``ResidualBlocks`` and ``h``); for transformers' ``kimi_linear`` (K3's parts off), the hidden
state. Gradients (transformers): the whole model's backward on one batch, each layer's parameters grouped by type.
Decoding token by token against a full forward: a model of KDA layers only (the recurrent state and the short
convolutions' tails) and one of MLA layers only (the latent cache)."""

from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch
from mlx_lm.models.kimi_k3 import ResidualBlocks, create_attention_mask, create_ssm_mask
from mlx_lm.utils import load_model

from policy.attnres import DepthStream
from policy.config import K3Config, k3_mini
from policy.hf_format import write_checkpoint
from policy.model import K3Model
from tests.unit.policy.test_policy_ep import decode
from tests.unit.policy.test_policy_hf_format import (
    HF_TOL,
    K3_PARTS_ON,
    MLX_TOL,
    SMALL,
    grads_on_disk,
    kimi_linear_pair,
    mlx_decode,
    one_batch,
    random_model,
    tokens,
)

Stream = list[torch.Tensor]  # what a decoder layer reads: AttnRes's sealed blocks then the open partial sum


def layer_type(cfg: K3Config, i: int) -> str:
    return f"dense ({cfg.layer_kind(i).upper()})" if cfg.is_dense(i) else f"{cfg.layer_kind(i).upper()}+MoE"


def streams(model: K3Model, ids: torch.Tensor) -> list[tuple[Stream, Stream]]:
    """Each decoder layer's stream before it and after it, in one forward of ours."""
    seen: list[list[Stream]] = []
    hooks = [h for layer in model.layers for h in (
        layer.register_forward_pre_hook(lambda _m, args: seen.append([list(args[0].sources())])),
        layer.register_forward_hook(lambda _m, args, _out: seen[-1].append(list(args[0].sources()))))]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return [(before, after) for before, after in seen]


def shown(table: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2g}" for k, v in table.items())


def by_type(cfg: K3Config, diffs: dict[int, float]) -> dict[str, float]:
    """The largest of each layer type's figures."""
    out: dict[str, float] = defaultdict(float)
    for i, d in diffs.items():
        out[layer_type(cfg, i)] = max(out[layer_type(cfg, i)], d)
    return dict(out)


def test_each_layer_type_agrees_with_mlx_lm_kimi_k3(tmp_path):
    cfg = k3_mini(**SMALL, **K3_PARTS_ON)
    model = random_model(cfg)
    reference, _ = load_model(write_checkpoint(model.state_dict(), cfg, tmp_path / "k3"))
    ids = tokens()
    diffs: dict[int, float] = {}
    for i, (before, after) in enumerate(streams(model, ids)):
        layer = reference.layers[i]
        blocks = ResidualBlocks(cfg.rms_norm_eps)
        for sealed in before[:-1]:   # ours seals a block at its end, mlx-lm at the next block's start: same sources
            blocks.append(mx.array(sealed.numpy()))
        h = mx.array(before[-1].numpy())
        mask = create_ssm_mask(h, None) if layer.is_linear else create_attention_mask(h, None, return_array=True)
        out, blocks = layer(h, mask=mask, cache=None, blocks=blocks)
        theirs = [*(np.array(blocks.raw) if blocks.raw is not None else []), np.array(out)]
        assert len(theirs) == len(after), i
        diffs[i] = max(float(np.abs(t - o.numpy()).max()) for t, o in zip(theirs, after, strict=True))
    table = by_type(cfg, diffs)
    print(f"per layer type, K3 (AttnRes, LatentMoE+norm, SiTU) vs mlx-lm kimi_k3: max abs output diff {shown(table)}")
    assert set(table) == {"dense (KDA)", "KDA+MoE", "MLA+MoE"}
    assert max(table.values()) < MLX_TOL


def alone(model: K3Model, ins: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each of our decoder layers run on its own input (AttnRes off: the hidden state): its output."""
    outs = []
    for layer, x in zip(model.layers, ins, strict=True):
        stream = DepthStream(x, None)
        layer(stream, None)
        outs.append(stream.sources()[-1])
    return outs


def fed(reference: torch.nn.Module, ids: torch.Tensor, ins: list[torch.Tensor]) -> list[torch.Tensor]:
    """transformers' kimi_linear on ``ids`` with each decoder layer fed ``ins[i]`` instead of what the layer before it
    gave: each layer's output."""
    layers, outs = reference.model.layers, []
    hooks = [layer.register_forward_pre_hook(lambda _m, args, kw, x=x: ((x, *args[1:]), kw), with_kwargs=True)
             for layer, x in zip(layers, ins, strict=True)]
    hooks += [layer.register_forward_hook(lambda _m, _args, out: outs.append(out)) for layer in layers]
    try:
        reference(ids)
    finally:
        for h in hooks:
            h.remove()
    return outs


def per_layer(grads: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]) -> dict[int, float]:
    """Max abs diff of each decoder layer's parameters' gradients (on-disk names ``model.layers.N.*``)."""
    ours, theirs = grads
    out: dict[int, float] = defaultdict(float)
    for name in (n for n in ours if n.startswith("model.layers.")):
        i = int(name.split(".")[2])
        out[i] = max(out[i], (ours[name] - theirs[name]).abs().max().item())
    return out


def test_each_layer_type_agrees_with_transformers_kimi_linear(tmp_path: Path):
    """Forward and gradients of each layer alone (both fed our stream before it, a fixed random gradient on its
    output), and each layer's gradients in the whole model's backward on one batch (what the trainer sees, every
    layer's error reaching the layers before it)."""
    cfg, model, reference = kimi_linear_pair(tmp_path)
    ids = tokens()
    ins = [before[-1] for before, _ in streams(model, ids)]
    ours, theirs = alone(model, ins), fed(reference, ids, ins)
    forward = by_type(cfg, {i: (o - t).abs().max().item() for i, (o, t) in enumerate(zip(ours, theirs, strict=True))})
    upstream = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(ours)]
    for outs in (ours, theirs):
        sum((o * u).sum() for o, u in zip(outs, upstream, strict=True)).backward()
    ours_grads, theirs_grads = grads_on_disk(model, reference, only="model.layers.")
    grads = by_type(cfg, per_layer((ours_grads, theirs_grads)))
    largest = by_type(cfg, per_layer((ours_grads, dict.fromkeys(ours_grads, torch.zeros(())))))
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    in_model = by_type(cfg, per_layer(one_batch(model, reference, ids).grads))
    print(f"per layer type, Kimi-Linear (K3's parts off) vs transformers kimi_linear: max abs output diff {shown(forward)}; "
          f"max abs grad diff of the layer's parameters: alone {shown(grads)} (largest grad: {shown(largest)}), "
          f"in the whole model's backward on one batch {shown(in_model)}")
    assert set(forward) == set(grads) == set(in_model) == {"dense (KDA)", "KDA+MoE", "MLA+MoE"}
    assert max(forward.values()) < HF_TOL
    assert all(grads[k] < 1e-5 * largest[k] for k in grads)   # alone, a unit gradient on every output: grads ~100
    assert max(in_model.values()) < 1e-4


def transformers_decode(reference: torch.nn.Module, ids: torch.Tensor) -> np.ndarray:
    """Row 0 of ``ids`` decoded by transformers' kimi_linear one token at a time (its own cache): each step's logits.
    One token at a time needs no mask; handing it none skips its mask builder, which raises on a cache of KDA
    layers only (transformers 5.25.0: "get_mask_sizes can only be called on Attention layers")."""
    cache, steps = None, []
    no_mask = {"full_attention": None, "linear_attention": None}
    with torch.no_grad():
        for t in range(ids.shape[1]):
            out = reference(ids[:1, t:t + 1], attention_mask=no_mask, cache=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[0, 0].numpy())
    return np.stack(steps)


def test_decoding_each_attention_type_agrees_with_a_full_forward(tmp_path):
    """A KDA-only and an MLA-only model: ours and a reference decoding one token at a time against our full forward
    at every step; K3 (every part on) with mlx-lm's kimi_k3, Kimi-Linear (K3's parts off) with transformers'."""
    ids = tokens()[:1]
    table: dict[str, dict[str, float]] = {}
    for kind, kda, mla in (("KDA", (1, 2, 3), ()), ("MLA", (), (1, 2, 3))):
        only = {"num_hidden_layers": 3, "kda_layers": kda, "full_attn_layers": mla}
        cfg = k3_mini(**{**SMALL, **K3_PARTS_ON, **only})
        model = random_model(cfg)
        reference, _ = load_model(write_checkpoint(model.state_dict(), cfg, tmp_path / kind))
        full, ours = decode(model, ids)
        table[f"K3 {kind}"] = {"ours": float(np.abs(ours - full).max()),
                               "mlx-lm": float(np.abs(mlx_decode(reference, ids) - full).max())}
        _, model, hf = kimi_linear_pair(tmp_path / kind, **only)
        full, ours = decode(model.eval(), ids)
        table[f"Kimi-Linear {kind}"] = {"ours": float(np.abs(ours - full).max()),
                                        "transformers": float(np.abs(transformers_decode(hf.eval(), ids) - full).max())}
    print("decode vs full forward per attention type:", "; ".join(f"{k}: {shown(v)}" for k, v in table.items()))
    assert max(d for row in table.values() for d in row.values()) < MLX_TOL
