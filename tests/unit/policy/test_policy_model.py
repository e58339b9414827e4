"""The full K3 model: K3's real config on the meta device, layer pattern, incremental decoding equivalence."""

from pathlib import Path

import pytest
import torch

from policy.config import K3Config, from_k3_json, k3_mini, preset
from policy.model import Cache, K3Model, param_counts

K3_JSON = Path(__file__).resolve().parents[2] / "data" / "k3" / "config.json"  # K3's released config, a copy


def test_k3_config_builds_on_meta_with_k3_counts():
    cfg = from_k3_json(K3_JSON)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_token) == (7168, 93, 896, 16)
    with torch.device("meta"):
        model = K3Model(cfg)
    kinds = [layer.kind for layer in model.layers]
    assert kinds.count("kda") == 69 and kinds.count("mla") == 24
    counts = param_counts(model)
    assert 2.6e12 < counts["total"] < 3.0e12, counts
    assert 95e9 < counts["active"] < 115e9, counts
    assert model.layers[0].mlp.__class__.__name__ == "SiTUMLP"
    assert model.layers[1].mlp.__class__.__name__ == "LatentMoE"


def test_k3_mini_pattern_and_config_round_trip():
    cfg = preset("k3-mini")
    assert [cfg.layer_kind(i) for i in range(8)] == ["kda"] * 3 + ["mla"] + ["kda"] * 3 + ["mla"]
    assert K3Config.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError):
        k3_mini(kda_layers=(1, 2, 3), full_attn_layers=(4, 8))


def _model(seed: int = 0) -> K3Model:
    torch.manual_seed(seed)
    return K3Model(k3_mini(vocab_size=300)).double().eval()


@torch.no_grad()
def test_token_by_token_decoding_equals_full_forward():
    model = _model()
    ids = torch.randint(0, 300, (2, 40))
    full, _ = model(ids)
    logits, cache = model(ids[:, :5])
    steps = [logits]
    for t in range(5, 40):
        step, cache = model(ids[:, t:t + 1], cache)
        steps.append(step)
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5
    # KDA state does not grow; MLA latent cache grows with the context
    kda = [c for c in cache.layers if hasattr(c, "recurrent")]
    mla = [c for c in cache.layers if hasattr(c, "latent")]
    assert all(c.recurrent.shape == (2, 4, 32, 32) for c in kda)
    assert all(c.latent.shape[1] == 40 for c in mla)


@torch.no_grad()
def test_batched_decode_of_different_lengths_equals_single():
    model = _model(1)
    seqs = [torch.randint(0, 300, (1, n)) for n in (3, 11, 7)]
    caches, singles = [], []
    for s in seqs:
        _, c = model(s)
        caches.append(c)
    nxt = torch.randint(0, 300, (3, 1))
    for i, s in enumerate(seqs):
        full, _ = model(torch.cat([s, nxt[i:i + 1]], 1))
        singles.append(full[:, -1])
    out, batch = model(nxt, Cache.stack(caches))
    assert (out[:, -1] - torch.cat(singles)).abs().max() < 1e-5
    split = batch.unstack()
    assert [c.layers[3].latent.shape[1] for c in split] == [4, 12, 8]
