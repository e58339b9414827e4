"""The Kimi checkpoint format's agreement per layer type, per reference, on the same fp32 weights
(whole-model figures: test_policy_hf_format.py). The layer types: the first, dense layer (``first_k_dense_replace``;
KDA attention here), a KDA layer with MoE and an MLA layer with MoE; with K3's parts on, Attention Residuals' mixing
and LatentMoE are inside those layers.

Each reference layer is fed the same input as ours, the stream our forward holds before that layer, so a layer's
figure is its own and not what the layers before it left: for mlx-lm's ``kimi_k3``, AttnRes's sealed blocks and open
partial sum (its ``ResidualBlocks`` and ``h``); for transformers' ``kimi_linear`` (K3's parts off), the hidden
state. Gradients of each layer's parameters, grouped by type: each layer alone (cut from the ones before it, a fixed
random gradient on its output), against both references; and, against transformers, in the whole model's backward
on one batch (what the trainer sees).
Decoding token by token against a full forward: a model of KDA layers only (the recurrent state and the short
convolutions' tails) and one of MLA layers only (the latent cache)."""

import re
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import torch
from mlx.utils import tree_flatten
from mlx_lm.models.kimi_k3 import ResidualBlocks, create_attention_mask, create_ssm_mask
from mlx_lm.utils import load_model

from policy.attnres import DepthStream
from policy.config import K3Config, k3_mini
from policy.hf_format import to_disk, write_checkpoint
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
Grads = dict[str, torch.Tensor]   # a gradient per tensor name


def layer_type(cfg: K3Config, i: int) -> str:
    return f"dense ({cfg.layer_kind(i).upper()})" if cfg.is_dense(i) else f"{cfg.layer_kind(i).upper()}+MoE"


def cut(_layer: torch.nn.Module, args: tuple[DepthStream, object]) -> None:
    """A pre-hook: the stream a layer reads becomes leaves that want a gradient, so the layer's output and gradients
    are its own, not what the layers before it left."""
    stream = args[0]
    stream.blocks = [b.detach().requires_grad_() for b in stream.blocks]
    if stream.partial is not None:
        stream.partial = stream.partial.detach().requires_grad_()


def streams(model: K3Model, ids: torch.Tensor) -> list[tuple[Stream, Stream]]:
    """Each decoder layer's stream before it (leaves) and after it, in one forward of ours with every layer cut from
    the ones before it."""
    seen: list[list[Stream]] = []
    hooks = [h for layer in model.layers for h in (
        layer.register_forward_pre_hook(cut),
        layer.register_forward_pre_hook(lambda _m, args: seen.append([list(args[0].sources())])),
        layer.register_forward_hook(lambda _m, args, _out: seen[-1].append(list(args[0].sources()))))]
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    return [(before, after) for before, after in seen]


def upstream(outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A fixed random gradient for each layer's output."""
    return [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(outs)]


def backward(outs: list[torch.Tensor]) -> None:
    sum((o * u).sum() for o, u in zip(outs, upstream(outs), strict=True)).backward()


def shown(table: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2g}" for k, v in table.items())


def by_type(cfg: K3Config, diffs: dict[int, float]) -> dict[str, float]:
    """The largest of each layer type's figures."""
    out: dict[str, float] = defaultdict(float)
    for i, d in diffs.items():
        out[layer_type(cfg, i)] = max(out[layer_type(cfg, i)], d)
    return dict(out)


def grad_table(cfg: K3Config, ours: Grads, theirs: Grads) -> tuple[dict[str, float], dict[str, float]]:
    """Per layer type: the max abs diff of the layers' parameters' gradients, and the largest of our gradients."""
    largest = per_layer((ours, dict.fromkeys(ours, torch.zeros(()))))
    return by_type(cfg, per_layer((ours, theirs))), by_type(cfg, largest)


def mlx_layer(layer: Any, sealed: list[mx.array], mask: Any, eps: float,
              h: mx.array) -> tuple[mx.array, ResidualBlocks]:
    """mlx-lm's decoder layer on our stream: ours seals a block at its end, mlx-lm at the next block's start, so our
    sealed blocks are its ``ResidualBlocks`` and our open partial sum (or last sealed block) its ``h``."""
    blocks = ResidualBlocks(eps)
    for block in sealed:
        blocks.append(block)
    return layer(h, mask=mask, cache=None, blocks=blocks)


def weighted(run: Callable[[mx.array], tuple[mx.array, ResidualBlocks]], u: mx.array, h: mx.array) -> mx.array:
    return (run(h)[0] * u).sum()


def test_each_layer_type_agrees_with_mlx_lm_kimi_k3(tmp_path):
    """Forward and the gradients of each layer's parameters, each layer alone (fed our stream before it, a fixed
    random gradient on its output); ours mapped onto mlx-lm's parameters by its own ``sanitize``."""
    cfg = k3_mini(**SMALL, **K3_PARTS_ON)
    model = random_model(cfg)
    reference, _ = load_model(write_checkpoint(model.state_dict(), cfg, tmp_path / "k3"))
    reference.train()   # its AttnRes weights recomputed at every call, not cached, so that they get a gradient
    ids = tokens()
    cuts = streams(model, ids)
    backward([after[-1] for _, after in cuts])
    diffs: dict[int, float] = {}
    theirs_grads: dict[str, mx.array] = {}
    for i, ((before, after), u) in enumerate(zip(cuts, upstream([a[-1] for _, a in cuts]), strict=True)):
        layer = reference.layers[i]
        h = mx.array(before[-1].detach().numpy())
        mask = create_ssm_mask(h, None) if layer.is_linear else create_attention_mask(h, None, return_array=True)
        run = partial(mlx_layer, layer, [mx.array(b.detach().numpy()) for b in before[:-1]], mask, cfg.rms_norm_eps)
        out, blocks = run(h)
        theirs = [*(np.array(blocks.raw) if blocks.raw is not None else []), np.array(out)]
        assert len(theirs) == len(after), i
        diffs[i] = max(float(np.abs(t - o.detach().numpy()).max()) for t, o in zip(theirs, after, strict=True))
        _, grads = nn.value_and_grad(layer, partial(weighted, run, mx.array(u.numpy())))(h)
        theirs_grads.update({f"language_model.model.layers.{i}.{k}": g for k, g in tree_flatten(grads)})
    ours_grads = reference.sanitize({k: mx.array(g.numpy()) for k, g in to_disk(
        {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, cfg).items()})
    assert {k.rsplit(".", 1)[-1] for k in theirs_grads.keys() - ours_grads.keys()} == {"e_score_correction_bias"}
    assert ours_grads.keys() <= theirs_grads.keys()   # every other parameter of every layer (a buffer in ours)
    forward = by_type(cfg, diffs)
    grads, largest = grad_table(cfg, {k: torch.from_numpy(np.array(g)) for k, g in ours_grads.items()},
                                {k: torch.from_numpy(np.array(theirs_grads[k])) for k in ours_grads})
    print(f"per layer type, K3 (AttnRes, LatentMoE+norm, SiTU) vs mlx-lm kimi_k3: max abs output diff "
          f"{shown(forward)}; max abs grad diff of the layer's parameters, alone: {shown(grads)} "
          f"(largest grad: {shown(largest)})")
    assert set(forward) == set(grads) == {"dense (KDA)", "KDA+MoE", "MLA+MoE"}
    assert max(forward.values()) < MLX_TOL
    assert all(grads[k] < 2e-5 * largest[k] for k in grads)   # a unit gradient on every output: grads ~100s


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


def per_layer(grads: tuple[Grads, Grads]) -> dict[int, float]:
    """Max abs diff of each decoder layer's parameters' gradients (names ``...layers.N.*``)."""
    ours, theirs = grads
    out: dict[int, float] = defaultdict(float)
    for name in ours:
        if not (m := re.search(r"(?:^|\.)layers\.(\d+)\.", name)):
            continue
        i = int(m.group(1))
        out[i] = max(out[i], (ours[name] - theirs[name]).abs().max().item())
    return out


def test_each_layer_type_agrees_with_transformers_kimi_linear(tmp_path: Path):
    """Forward and gradients of each layer alone (both fed our stream before it, a fixed random gradient on its
    output), and each layer's gradients in the whole model's backward on one batch (what the trainer sees, every
    layer's error reaching the layers before it)."""
    cfg, model, reference = kimi_linear_pair(tmp_path)
    ids = tokens()
    cuts = streams(model, ids)
    ours = [after[-1] for _, after in cuts]
    theirs = fed(reference, ids, [before[-1].detach() for before, _ in cuts])
    forward = by_type(cfg, {i: (o - t).abs().max().item() for i, (o, t) in enumerate(zip(ours, theirs, strict=True))})
    backward(ours)
    backward(theirs)
    grads, largest = grad_table(cfg, *grads_on_disk(model, reference, only="model.layers."))
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    in_model = by_type(cfg, per_layer(one_batch(model, reference, ids).grads))
    print(f"per layer type, Kimi-Linear (K3's parts off) vs transformers kimi_linear: max abs output diff "
          f"{shown(forward)}; max abs grad diff of the layer's parameters: alone {shown(grads)} "
          f"(largest grad: {shown(largest)}), in the whole model's backward on one batch {shown(in_model)}")
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
