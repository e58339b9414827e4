"""The Kimi checkpoint format against its two independent readers, on the same fp32 weights: a small random K3
(KDA and MLA layers, AttnRes blocks, LatentMoE with its norm and shared experts, SiTU) written by
``policy.hf_format`` and loaded by mlx-lm's ``kimi_k3`` (CPU); the same with K3's parts off, loaded by transformers'
``kimi_linear``. Also: our reader reads back what we wrote, drops MTP layers, reads only a rank's experts, and
refuses MXFP4-packed experts and a vocabulary other than the tokenizer's."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from mlx_lm.utils import load_model
from safetensors.torch import save_file

from policy.config import K3Config, from_k3_json, k3_mini
from policy.hf_format import (
    FormatError,
    check_vocab,
    hf_config,
    read_checkpoint,
    read_config,
    to_disk,
    write_checkpoint,
)
from policy.model import K3Model
from tests.unit.policy.test_policy_ep import decode

K3_JSON = Path(__file__).resolve().parents[2] / "data" / "k3" / "config.json"  # K3's released config, a copy
MLX_TOL = 1e-3      # fp32 logits of magnitude ~4: ours alone is ~2e-4 from its own fp64 result (chunked KDA)
HF_TOL = 1e-4

SMALL: dict[str, Any] = dict(vocab_size=97, hidden_size=64, num_hidden_layers=5, intermediate_size=96, kda_layers=(1, 2, 4, 5),
             full_attn_layers=(3,), linear_num_heads=2, linear_head_dim=32, kda_chunk_size=8, num_attention_heads=2,
             q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=8,
             num_experts_per_token=2, num_shared_experts=2, moe_intermediate_size=24)
K3_PARTS_ON: dict[str, Any] = dict(attn_res_block_size=2, routed_expert_hidden_size=32, latent_moe_use_norm=True, hidden_act="situ")
K3_PARTS_OFF: dict[str, Any] = dict(attn_res_block_size=None, routed_expert_hidden_size=None, hidden_act="silu",
                    mla_use_output_gate=False, gate_lower_bound=None, use_full_rank_gate=False)


def random_model(cfg: K3Config, seed: int = 0) -> K3Model:
    """Every parameter random (norms near 1, AttnRes queries and router biases non-zero), so that each tensor's
    name and layout matter to the logits."""
    torch.manual_seed(seed)
    model = K3Model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.5 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
        for moe in model.moe_layers():
            moe.router.e_score_correction_bias.normal_(0, 0.1)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (2, 21), generator=torch.Generator().manual_seed(1))


def test_k3_checkpoint_agrees_with_mlx_lm_kimi_k3(tmp_path):
    cfg = k3_mini(**SMALL, **K3_PARTS_ON)
    model = random_model(cfg)
    folder = write_checkpoint(model.state_dict(), cfg, tmp_path / "k3", shard_bytes=200_000)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "kimi_k3"
    assert len(list(folder.glob("model-*.safetensors"))) > 1  # sharded, with the index
    ids = tokens()
    with torch.no_grad():
        ours = model(ids)[0].numpy()
    reference, _ = load_model(folder)  # strict: every tensor must land on a parameter of kimi_k3
    theirs = np.array(reference(mx.array(ids.numpy())))
    diff = float(np.abs(theirs - ours).max())
    print(f"K3 (AttnRes, LatentMoE+norm, SiTU, KDA+MLA) vs mlx-lm kimi_k3: max abs logit diff {diff:.3g}")
    assert diff < MLX_TOL
    back = read_checkpoint(folder)
    assert back.cfg == cfg and back.wrapper
    for name, t in model.state_dict().items():
        assert torch.equal(back.state[name], t), name


def on_disk(params: dict[str, torch.nn.Parameter], names) -> dict[str, torch.Tensor]:
    """transformers' kimi_linear gradients under the on-disk names: its conversion mapping undone (forget gate
    moved, q/k/v convs joined, MoE renamed to ``mlp`` and its experts fused as gate_up_proj / down_proj)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        g = p.grad
        assert g is not None, name
        name = name.replace(".forget_gate.", ".")
        if name.endswith(".self_attn.conv1d.weight"):
            for part, t in zip("qkv", g.chunk(3), strict=True):
                out[name.replace("conv1d", f"{part}_conv1d")] = t
            continue
        moe = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith(".experts.gate_up_proj"):
            for e, t in enumerate(g):
                w1, w3 = t.chunk(2)
                out[moe.replace("gate_up_proj", f"{e}.w1.weight")] = w1
                out[moe.replace("gate_up_proj", f"{e}.w3.weight")] = w3
        elif name.endswith(".experts.down_proj"):
            out.update({moe.replace("down_proj", f"{e}.w2.weight"): t for e, t in enumerate(g)})
        else:
            out[name if name in names else moe] = g
    return out


@dataclass
class OneBatch:
    """Ours and transformers' kimi_linear on one batch: logits, next-token loss, and every tensor's gradient under
    its on-disk name (ours, theirs)."""

    logits: tuple[torch.Tensor, torch.Tensor]
    loss: tuple[float, float]
    grads: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]


def kimi_linear_pair(tmp_path: Path, **overrides: Any) -> tuple[K3Config, K3Model, torch.nn.Module]:
    """A small random Kimi-Linear model (K3's parts off; ``SMALL`` but for ``overrides``), in train mode, and
    transformers' kimi_linear loaded from the folder we write for it."""
    cfg = k3_mini(**{**SMALL, **K3_PARTS_OFF, **overrides})
    model = random_model(cfg).train()
    folder = write_checkpoint(model.state_dict(), cfg, tmp_path / "kl")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "kimi_linear"
    return cfg, model, transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()


def one_batch(model: K3Model, reference: torch.nn.Module, ids: torch.Tensor) -> OneBatch:
    ours = model(ids)[0]
    theirs = reference(ids).logits
    loss_ours = torch.nn.functional.cross_entropy(ours[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss_theirs = torch.nn.functional.cross_entropy(theirs[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss_ours.backward()
    loss_theirs.backward()
    return OneBatch((ours, theirs), (loss_ours.item(), loss_theirs.item()), grads_on_disk(model, reference))


def grads_on_disk(model: K3Model, reference: torch.nn.Module, only: str = "") -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Our gradients and transformers' (those of its parameters named ``only...``) under the on-disk names: every
    tensor's, in both."""
    ours = to_disk({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, model.cfg)
    theirs = on_disk({n: p for n, p in reference.named_parameters() if n.startswith(only)}, ours.keys())
    assert theirs.keys() == ours.keys()
    return ours, theirs


def test_kimi_linear_checkpoint_agrees_with_transformers(tmp_path):
    _, model, reference = kimi_linear_pair(tmp_path)
    got = one_batch(model, reference, tokens())
    diff = (got.logits[0] - got.logits[1]).abs().max().item()
    loss_diff = abs(got.loss[0] - got.loss[1])
    ours_grads, theirs_grads = got.grads
    grad_diff = max((ours_grads[n] - g).abs().max().item() for n, g in theirs_grads.items())
    print(f"Kimi-Linear (K3's parts off) vs transformers kimi_linear: max abs logit diff {diff:.3g}, "
          f"loss diff {loss_diff:.3g}, max abs grad diff {grad_diff:.3g} over {len(theirs_grads)} tensors")
    assert diff < HF_TOL
    assert loss_diff < 1e-5
    assert grad_diff < 1e-4


def test_reader_drops_mtp_reads_one_ranks_experts_and_refuses_strays(tmp_path):
    cfg = k3_mini(**SMALL, **K3_PARTS_ON)
    model = random_model(cfg)
    folder = write_checkpoint(model.state_dict(), cfg, tmp_path / "k3")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    extra = {"language_model.model.mtp.0.weight": torch.ones(3),
             f"language_model.model.layers.{cfg.num_hidden_layers}.input_layernorm.weight": torch.ones(3)}
    save_file(extra, str(folder / "mtp.safetensors"))
    index["weight_map"].update(dict.fromkeys(extra, "mtp.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    rank1 = read_checkpoint(folder, experts=range(4, 8))
    w_gate = model.state_dict()["layers.1.mlp.experts.w_gate"]
    assert torch.equal(rank1.state["layers.1.mlp.experts.w_gate"], w_gate[4:8])
    assert torch.equal(rank1.state["layers.1.mlp.router.weight"], model.state_dict()["layers.1.mlp.router.weight"])
    save_file({"language_model.model.layers.0.self_attn.stray.weight": torch.ones(2)}, str(folder / "stray.safetensors"))
    index["weight_map"]["language_model.model.layers.0.self_attn.stray.weight"] = "stray.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FormatError, match="no place for"):
        read_checkpoint(folder)


def test_mxfp4_release_and_vocabulary_mismatch_are_refused(tmp_path):
    with pytest.raises(FormatError, match="MXFP4"):
        read_config(K3_JSON.parent)
    released = json.loads(K3_JSON.read_text())
    del released["text_config"]["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(released))
    cfg, wrapper = read_config(tmp_path)
    assert wrapper and cfg == from_k3_json(K3_JSON)
    assert (cfg.attn_res_block_size, cfg.routed_expert_hidden_size, cfg.hidden_act) == (12, 3584, "situ")
    (tmp_path / "again.json").write_text(json.dumps(hf_config(cfg)))
    assert from_k3_json(tmp_path / "again.json") == cfg  # our config.json reads back to the same model
    with pytest.raises(FormatError, match="163840 tokens.*never its tokenizer"):
        check_vocab(cfg, 4096)


def test_export_turns_an_old_single_file_into_a_folder_the_references_load(tmp_path):
    from typer.testing import CliRunner

    from policy.cli import app
    cfg = k3_mini(**SMALL, **K3_PARTS_ON)
    model = random_model(cfg)
    save_file(model.state_dict(), str(tmp_path / "old.safetensors"))   # what pushes and `agentenv train` wrote before
    (tmp_path / "cfg.json").write_text(json.dumps(cfg.to_dict()))
    out = CliRunner().invoke(app, ["export", str(tmp_path / "old.safetensors"), str(tmp_path / "kimi"),
                                   "--model-config", str(tmp_path / "cfg.json")])
    assert out.exit_code == 0, out.output
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= {p.name for p in (tmp_path / "kimi").iterdir()}
    reference, _ = load_model(tmp_path / "kimi")
    ids = tokens()
    with torch.no_grad():
        ours = model(ids)[0].numpy()
    assert float(np.abs(np.array(reference(mx.array(ids.numpy()))) - ours).max()) < MLX_TOL


def test_k3_release_names_and_shapes_are_what_mlx_lm_kimi_k3_expects():
    """K3's released config on the meta device: every tensor we would write, under its on-disk name and shape, goes
    through mlx-lm's own ``sanitize`` onto exactly the parameters its ``kimi_k3`` builds (mlx stays lazy: nothing is
    allocated); the counts are K3's published ~2.8T total / ~104B active."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import kimi_k3

    from policy.model import param_counts
    cfg = from_k3_json(K3_JSON)
    with torch.device("meta"):
        model = K3Model(cfg)
    counts = param_counts(model)
    print(f"K3 on meta: {counts['total'] / 1e12:.3f}T total, {counts['active'] / 1e9:.1f}B active")
    assert 2.7e12 < counts["total"] < 2.9e12 and 100e9 < counts["active"] < 110e9
    disk = to_disk(model.state_dict(), cfg)
    released = json.loads(K3_JSON.read_text())
    del released["text_config"]["quantization_config"]  # the bf16 layout; MXFP4 is refused (test above)
    reference = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(released))
    expected = {k: tuple(v.shape) for k, v in tree_flatten(reference.parameters())}
    placed = reference.sanitize({k: mx.zeros(tuple(v.shape), dtype=mx.bfloat16) for k, v in disk.items()})
    assert {k: tuple(v.shape) for k, v in placed.items()} == expected


def test_an_expert_parallel_rank_loads_its_shard_from_a_folder_or_an_old_file(tmp_path):
    from policy.ep import EPGroup, shard_state_dict
    from policy.hf_format import load_state
    cfg = k3_mini(**SMALL, **K3_PARTS_ON)
    full = random_model(cfg).state_dict()
    write_checkpoint(full, cfg, tmp_path / "k3")
    save_file(full, str(tmp_path / "old.safetensors"))
    rank = EPGroup(rank=1, world=2)
    want = shard_state_dict(full, rank)
    for path in (tmp_path / "k3", tmp_path / "old.safetensors"):
        got = load_state(path, cfg, rank)
        assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items()), path
    with pytest.raises(FormatError, match="different model"):
        load_state(tmp_path / "k3", k3_mini(**SMALL))


def test_a_single_unsharded_file_with_attnres_other_spelling_reads_the_same(tmp_path):
    from safetensors.torch import load_file
    cfg = k3_mini(**SMALL, **K3_PARTS_ON)
    state = random_model(cfg).state_dict()
    folder = write_checkpoint(state, cfg, tmp_path / "k3")
    (shard,) = folder.glob("model-*.safetensors")
    tensors = {k.replace("_res_proj.weight", "_res.proj_weight").replace("_res_norm.weight", "_res.norm_weight"): v
               for k, v in load_file(str(shard)).items()}   # the spelling mlx-lm's sanitize renames from
    assert "language_model.model.output_attn_res.proj_weight" in tensors
    shard.unlink()
    (folder / "model.safetensors.index.json").unlink()
    save_file(tensors, str(folder / "model.safetensors"))
    back = read_checkpoint(folder).state
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_decoding_token_by_token_agrees_with_mlx_lm_and_with_a_full_forward(tmp_path):
    """EP=1 (EP=2: test_policy_ep.py): mlx-lm's kimi_k3 decoding one token at a time (KDA's recurrent state, MLA's
    latent cache with its absorbed projections) against our full forward at every step, and our own decoding (our
    caches) against the same."""
    cfg = k3_mini(**SMALL, **K3_PARTS_ON)
    model = random_model(cfg)
    reference, _ = load_model(write_checkpoint(model.state_dict(), cfg, tmp_path / "k3"))
    ids = tokens()[:1]
    full, ours = decode(model, ids)
    mlx_diff = float(np.abs(mlx_decode(reference, ids) - full).max())
    ours_diff = float(np.abs(ours - full).max())
    print(f"decode vs full forward, K3 all parts on: mlx-lm kimi_k3 {mlx_diff:.3g}, ours {ours_diff:.3g}")
    assert mlx_diff < MLX_TOL and ours_diff < MLX_TOL


def mlx_decode(reference: Any, ids: torch.Tensor) -> np.ndarray:
    """Row 0 of ``ids`` decoded by mlx-lm's kimi_k3 one token at a time (its own caches): the logits of each step."""
    cache = reference.make_cache()
    return np.stack([np.array(reference(mx.array(ids[:1, t:t + 1].numpy()), cache=cache))[0, 0]
                     for t in range(ids.shape[1])])


class Takes:
    """An engine in process: takes the folder a push hands it (``WeightSync``'s ``Loads``)."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def update_weights(self, path: str, mode: str = "drain", timeout: float = 600.0) -> int:
        self.paths.append(path)
        return len(self.paths)


def test_a_trainer_push_with_k3_s_parts_off_loads_into_transformers_kimi_linear(tmp_path):
    """What a push hands an engine after a training step, with K3's parts off (a Kimi-Linear model): a folder that
    transformers' kimi_linear loads, with the trained weights' logits (a push with the parts on, into mlx-lm's
    kimi_k3: test_trainer_train.py)."""
    from trainer.algorithm.batch import Batch, Sample
    from trainer.distributed.sync import WeightSync
    from trainer.train import TrainConfig, Trainer
    cfg = k3_mini(**SMALL, **K3_PARTS_OFF)
    ids = tokens()
    engine = Takes()
    with Trainer(cfg, TrainConfig(lr=1e-2)) as t:
        before = {k: v.clone() for k, v in t.state_dict().items()}
        t.step(Batch([Sample(row.tolist(), [0] + [1] * (len(row) - 1), [0.0] * len(row)) for row in ids], kind="sft"))
        assert any(not torch.equal(before[k], v) for k, v in t.state_dict().items())   # trained weights
        res = WeightSync([engine], str(tmp_path / "weights")).push(t)
        with torch.no_grad():
            ours = t.model.eval()(ids)[0]
    assert engine.paths == [res.path]
    assert json.loads((Path(res.path) / "config.json").read_text())["model_type"] == "kimi_linear"
    reference = transformers.AutoModelForCausalLM.from_pretrained(res.path, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (reference(ids).logits - ours).abs().max().item()
    print(f"a trainer's push, K3's parts off, into transformers kimi_linear: max abs logit diff {diff:.3g}")
    assert diff < HF_TOL
