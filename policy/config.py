"""K3Config: the model's hyper-parameters, named after the fields of Kimi K3's ``config.json``.

One dataclass serves both the real 2.8T-parameter K3 (``from_k3_json``) and the small ``k3-mini``
preset that trains and serves on two CPU cores; parameter counts are computed from the shapes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class K3Config:
    """Text-model hyper-parameters; layer lists are 1-indexed like K3's ``linear_attn_config``."""

    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    intermediate_size: int = 33792  # dense (first_k_dense_replace) layers
    first_k_dense_replace: int = 1
    rms_norm_eps: float = 1e-5
    # KDA (linear_attn_config)
    kda_layers: tuple[int, ...] = ()
    full_attn_layers: tuple[int, ...] = ()
    linear_num_heads: int = 96
    linear_head_dim: int = 128
    short_conv_kernel_size: int = 4
    # K3: the forget gate's log-decay is ``lower_bound·sigmoid(...)``; None (Kimi-Linear): ``-exp(A_log)·softplus(...)``
    gate_lower_bound: float | None = -5.0
    use_full_rank_gate: bool = True  # KDA's output gate: one full-rank g_proj (K3) or low-rank g_a/g_b (Kimi-Linear)
    kda_chunk_size: int = 64
    # gated MLA, no positional encoding
    num_attention_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_output_gate: bool = True  # K3's sigmoid gate on MLA's output (Kimi-Linear has none)
    # Attention Residuals: block size counted in decoder layers, as K3's config.json and mlx-lm's kimi_k3 count it
    # (a block starts at every layer whose index is a multiple); None switches AttnRes off (plain residual sums)
    attn_res_block_size: int | None = 12
    # LatentMoE
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    # LatentMoE: routed experts run in this width between down/up projections; None runs them at hidden_size
    routed_expert_hidden_size: int | None = 3584
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    latent_moe_use_norm: bool = True  # an RMSNorm on the routed experts' combined latent output, before up-projection
    hidden_act: str = "situ"  # every MLP's activation: K3's SiTU, or SwiGLU's "silu" (Kimi-Linear)
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    # special ids (filled from the tokenizer for k3-mini)
    bos_token_id: int = 163584
    eos_token_id: int = 163586
    pad_token_id: int = 163839

    # K3's config.json calls these n_routed_experts / num_experts_per_tok in some releases.
    @property
    def n_routed_experts(self) -> int:
        return self.num_experts

    @property
    def num_experts_per_tok(self) -> int:
        return self.num_experts_per_token

    @property
    def n_shared_experts(self) -> int:
        return self.num_shared_experts

    def layer_kind(self, layer_idx: int) -> str:
        """Return ``"kda"`` or ``"mla"`` for the 0-indexed layer ``layer_idx``."""
        n = layer_idx + 1
        if n in self.kda_layers:
            return "kda"
        if n in self.full_attn_layers:
            return "mla"
        raise ValueError(f"layer {n} is in neither kda_layers nor full_attn_layers")

    def is_dense(self, layer_idx: int) -> bool:
        """The first ``first_k_dense_replace`` layers use a dense MLP instead of MoE."""
        return layer_idx < self.first_k_dense_replace

    def validate(self) -> K3Config:
        """Check that the layer lists cover every layer exactly once and top-k fits."""
        both = sorted([*self.kda_layers, *self.full_attn_layers])
        if both != list(range(1, self.num_hidden_layers + 1)):
            raise ValueError("kda_layers and full_attn_layers must partition 1..num_hidden_layers")
        if not 0 < self.num_experts_per_token <= self.num_experts:
            raise ValueError("num_experts_per_token must be in 1..num_experts")
        if self.hidden_act not in ("situ", "silu"):
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; use 'situ' (K3) or 'silu' (Kimi-Linear)")
        if self.attn_res_block_size is not None and self.attn_res_block_size < 1:
            raise ValueError("attn_res_block_size must be a positive number of layers, or None (AttnRes off)")
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> K3Config:
        names = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names}
        return cls(**kw).validate()


def from_k3_json(path: str | Path) -> K3Config:
    """Read a real K3 ``config.json`` (top-level or ``text_config``) into a K3Config."""
    raw = json.loads(Path(path).read_text())
    tc = raw.get("text_config", raw)
    lin = tc["linear_attn_config"]
    return K3Config(
        vocab_size=tc["vocab_size"],
        hidden_size=tc["hidden_size"],
        num_hidden_layers=tc["num_hidden_layers"],
        intermediate_size=tc["intermediate_size"],
        first_k_dense_replace=tc.get("first_k_dense_replace", 1),
        rms_norm_eps=tc.get("rms_norm_eps", 1e-5),
        kda_layers=tuple(lin["kda_layers"]),
        full_attn_layers=tuple(lin["full_attn_layers"]),
        linear_num_heads=lin["num_heads"],
        linear_head_dim=lin["head_dim"],
        short_conv_kernel_size=lin.get("short_conv_kernel_size", 4),
        gate_lower_bound=lin.get("gate_lower_bound"),
        use_full_rank_gate=lin.get("use_full_rank_gate", False),
        kda_chunk_size=lin.get("chunk_size", 64),
        num_attention_heads=tc["num_attention_heads"],
        q_lora_rank=tc["q_lora_rank"],
        kv_lora_rank=tc["kv_lora_rank"],
        qk_nope_head_dim=tc["qk_nope_head_dim"],
        qk_rope_head_dim=tc["qk_rope_head_dim"],
        v_head_dim=tc["v_head_dim"],
        mla_use_output_gate=tc.get("mla_use_output_gate", False),
        attn_res_block_size=tc.get("attn_res_block_size"),
        num_experts=tc.get("num_experts", tc.get("n_routed_experts", 0)),
        num_experts_per_token=tc.get("num_experts_per_token", tc.get("num_experts_per_tok", 0)),
        num_shared_experts=tc.get("num_shared_experts", tc.get("n_shared_experts", 0)),
        moe_intermediate_size=tc["moe_intermediate_size"],
        routed_expert_hidden_size=tc.get("routed_expert_hidden_size"),
        routed_scaling_factor=tc.get("routed_scaling_factor", 1.0),
        moe_renormalize=tc.get("moe_renormalize", True),
        latent_moe_use_norm=tc.get("latent_moe_use_norm", False),
        hidden_act=tc.get("hidden_act", "silu"),
        activation_situ_beta=tc.get("activation_situ_beta", 4.0),
        activation_situ_linear_beta=tc.get("activation_situ_linear_beta", 25.0),
        tie_word_embeddings=tc.get("tie_word_embeddings", False),
        max_position_embeddings=tc.get("max_position_embeddings", 1048576),
        bos_token_id=tc.get("bos_token_id", 0),
        eos_token_id=tc.get("eos_token_id", 0),
        pad_token_id=tc.get("pad_token_id", 0),
    ).validate()


def k3_mini(vocab_size: int = 4096, **overrides: Any) -> K3Config:
    """The ``k3-mini`` preset: K3's architecture at hidden 256, 8 layers (3:1 KDA:MLA), 64 experts."""
    cfg = K3Config(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=8,
        intermediate_size=512,
        kda_layers=(1, 2, 3, 5, 6, 7),
        full_attn_layers=(4, 8),
        linear_num_heads=4,
        linear_head_dim=32,
        kda_chunk_size=16,
        num_attention_heads=4,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        attn_res_block_size=2,
        num_experts=64,
        num_experts_per_token=4,
        num_shared_experts=1,
        moe_intermediate_size=128,
        routed_expert_hidden_size=128,
        max_position_embeddings=32768,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return replace(cfg, **overrides).validate()


PRESETS = {"k3-mini": k3_mini}


def preset(name: str, **overrides: Any) -> K3Config:
    """Look up a named preset (currently ``k3-mini``)."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name](**overrides)


def model_config(name: str = "k3-mini", config_file: Path | None = None) -> K3Config:
    """The model configuration the policy server uses for preset ``name`` (sized to the tokenizer's vocabulary
    and special ids), or the one a JSON file describes (``K3Config`` fields)."""
    if config_file is not None:
        return K3Config.from_dict(json.loads(config_file.read_text()))
    from policy.tokenizer import load_tokenizer
    tok = load_tokenizer()
    return preset(name, vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                  pad_token_id=tok.pad_id)
