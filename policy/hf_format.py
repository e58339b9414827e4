"""The Kimi family's own Hugging Face checkpoint format, both ways: k3-mini's state dict <-> the on-disk tensor names
that K3's and Kimi-Linear's loaders read (mlx-lm's ``kimi_k3``, transformers' ``kimi_linear``, vLLM, SGLang).

A folder holds ``config.json`` (K3's ``kimi_k3`` wrapper with ``text_config`` when any of K3's parts is on, else
Kimi-Linear's top-level ``kimi_linear``), safetensors shards with ``model.safetensors.index.json``, and, when we
write it, our tokenizer's files. The wrapper puts ``language_model.`` before every tensor name.

On disk, unlike in memory: routed experts are one tensor per expert and projection
(``block_sparse_moe.experts.E.w1/w2/w3``, (out, in) like ``nn.Linear``); the short convolutions are (C, 1, K);
``A_log`` is (1, 1, H, 1); AttnRes's pseudo-queries are ``*_res_proj.weight`` (1, D). Reading drops multi-token
prediction layers (``mtp``, layers past ``num_hidden_layers``) and the vision tower, keeps the stored dtype, and
reads only the tensors asked for, so an expert-parallel rank reads only its experts. MXFP4-packed experts
(``weight_packed``, K3's release) are refused: k3-mini does not dequantise them. A checkpoint brings only its
weights, never its tokenizer: ``check_vocab`` refuses one whose vocabulary differs from ours.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from policy.config import K3Config, from_k3_json
from policy.ep import EPGroup, shard_state_dict

INDEX = "model.safetensors.index.json"
WRAPPER = "language_model."

# per decoder layer: our name (after ``layers.N.``) -> the name on disk (after ``model.layers.N.``) and its shape rule
_LAYER: dict[str, tuple[str, str]] = {
    "attn.A_log": ("self_attn.A_log", "a_log"),
    "attn.dt_bias": ("self_attn.dt_bias", "same"),
    **{f"attn.{p}_proj.weight": (f"self_attn.{p}_proj.weight", "same") for p in "qkvbo"},
    **{f"attn.{p}_conv.weight": (f"self_attn.{p}_conv1d.weight", "conv") for p in "qkv"},
    "attn.f_proj.0.weight": ("self_attn.f_a_proj.weight", "same"),
    "attn.f_proj.1.weight": ("self_attn.f_b_proj.weight", "same"),
    "attn.g_proj.weight": ("self_attn.g_proj.weight", "same"),
    "attn.g_proj.0.weight": ("self_attn.g_a_proj.weight", "same"),
    "attn.g_proj.1.weight": ("self_attn.g_b_proj.weight", "same"),
    "attn.o_norm.weight": ("self_attn.o_norm.weight", "same"),
    "attn.q_a_proj.weight": ("self_attn.q_a_proj.weight", "same"),
    "attn.q_a_norm.weight": ("self_attn.q_a_layernorm.weight", "same"),
    "attn.q_b_proj.weight": ("self_attn.q_b_proj.weight", "same"),
    "attn.kv_a_proj.weight": ("self_attn.kv_a_proj_with_mqa.weight", "same"),
    "attn.kv_a_norm.weight": ("self_attn.kv_a_layernorm.weight", "same"),
    "attn.kv_b_proj.weight": ("self_attn.kv_b_proj.weight", "same"),
    **{f"mlp.{p}_proj.weight": (f"mlp.{p}_proj.weight", "same") for p in ("gate", "up", "down")},
    "mlp.router.weight": ("block_sparse_moe.gate.weight", "same"),
    "mlp.router.e_score_correction_bias": ("block_sparse_moe.gate.e_score_correction_bias", "same"),
    **{f"mlp.shared_experts.{p}_proj.weight": (f"block_sparse_moe.shared_experts.{p}_proj.weight", "same")
       for p in ("gate", "up", "down")},
    "mlp.latent_down.weight": ("block_sparse_moe.routed_expert_down_proj.weight", "same"),
    "mlp.latent_norm.weight": ("block_sparse_moe.routed_expert_norm.weight", "same"),
    "mlp.latent_up.weight": ("block_sparse_moe.routed_expert_up_proj.weight", "same"),
    "mlp.experts.w_gate": ("block_sparse_moe.experts.{e}.w1.weight", "experts"),
    "mlp.experts.w_down": ("block_sparse_moe.experts.{e}.w2.weight", "experts"),
    "mlp.experts.w_up": ("block_sparse_moe.experts.{e}.w3.weight", "experts"),
    "attn_norm.weight": ("input_layernorm.weight", "same"),
    "mlp_norm.weight": ("post_attention_layernorm.weight", "same"),
    "attn_res.query": ("self_attention_res_proj.weight", "row"),
    "attn_res.norm.weight": ("self_attention_res_norm.weight", "same"),
    "mlp_res.query": ("mlp_res_proj.weight", "row"),
    "mlp_res.norm.weight": ("mlp_res_norm.weight", "same"),
}
_TOP: dict[str, tuple[str, str]] = {
    "embed_tokens.weight": ("model.embed_tokens.weight", "same"),
    "norm.weight": ("model.norm.weight", "same"),
    "final_res.query": ("model.output_attn_res_proj.weight", "row"),
    "final_res.norm.weight": ("model.output_attn_res_norm.weight", "same"),
    "lm_head.weight": ("lm_head.weight", "same"),
}


class FormatError(ValueError):
    """A folder that is not a Kimi checkpoint k3-mini can read; the message says what to do."""


def uses_wrapper(cfg: K3Config) -> bool:
    """K3's parts on (any of AttnRes, LatentMoE, SiTU): the ``kimi_k3`` wrapper; all off: plain ``kimi_linear``."""
    return cfg.attn_res_block_size is not None or cfg.routed_expert_hidden_size is not None or cfg.hidden_act == "situ"


def hf_config(cfg: K3Config, dtype: str = "float32") -> dict[str, Any]:
    """``cfg`` as the ``config.json`` the references read (``policy.config.from_k3_json`` reads it back)."""
    d = cfg.to_dict()
    linear = {"kda_layers": list(d.pop("kda_layers")), "full_attn_layers": list(d.pop("full_attn_layers")),
              "num_heads": d.pop("linear_num_heads"), "head_dim": d.pop("linear_head_dim"),
              "short_conv_kernel_size": d.pop("short_conv_kernel_size"), "chunk_size": d.pop("kda_chunk_size"),
              "use_full_rank_gate": d.pop("use_full_rank_gate")}
    if (bound := d.pop("gate_lower_bound")) is not None:
        linear["gate_lower_bound"] = bound
    text = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "dtype": dtype,
            **{k: v for k, v in d.items() if v is not None}, "linear_attn_config": linear,
            "num_key_value_heads": cfg.num_attention_heads, "mla_use_nope": True, "moe_layer_freq": 1,
            "moe_router_activation_func": "sigmoid", "num_expert_group": 1, "topk_group": 1,
            "use_grouped_topk": True, "topk_method": "noaux_tc", "num_nextn_predict_layers": 0}
    if not uses_wrapper(cfg):
        return text
    ids = {k: d[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "dtype": dtype, **ids,
            "tie_word_embeddings": cfg.tie_word_embeddings, "text_config": text}


def _disk_names(ours: str) -> tuple[str, str]:
    """(disk name, shape rule) of one of our tensors, without the wrapper's prefix."""
    if ours.startswith("layers."):
        _, n, rest = ours.split(".", 2)
        if rest not in _LAYER:
            raise FormatError(f"no on-disk name for {ours!r}: add it to policy/hf_format.py's _LAYER")
        name, rule = _LAYER[rest]
        return f"model.layers.{n}.{name}", rule
    if ours not in _TOP:
        raise FormatError(f"no on-disk name for {ours!r}: add it to policy/hf_format.py's _TOP")
    return _TOP[ours]


def to_disk(state: dict[str, torch.Tensor], cfg: K3Config, experts: range | None = None) -> dict[str, torch.Tensor]:
    """Our state dict as on-disk tensors (``experts``: the global ids of the stacked experts; default all)."""
    prefix = WRAPPER if uses_wrapper(cfg) else ""
    ids = experts if experts is not None else range(cfg.num_experts)
    out: dict[str, torch.Tensor] = {}
    for ours, t in state.items():
        if ours == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name, rule = _disk_names(ours)
        t = t.detach()
        if rule == "experts":  # ours (E, in, out) -> one (out, in) per expert
            for i, e in enumerate(ids):
                out[prefix + name.format(e=e)] = t[i].t().contiguous()
            continue
        shaped = {"same": t, "conv": t.unsqueeze(1), "a_log": t.reshape(1, 1, -1, 1), "row": t.reshape(1, -1)}[rule]
        out[prefix + name] = shaped.contiguous()
    return out


def from_disk(want: dict[str, torch.Size], get: Callable[[str], torch.Tensor], cfg: K3Config,
              experts: range | None = None) -> dict[str, torch.Tensor]:
    """Our state dict (keys and shapes ``want``) from on-disk tensors ``get(name)`` (without the wrapper's prefix)."""
    ids = experts if experts is not None else range(cfg.num_experts)
    state: dict[str, torch.Tensor] = {}
    for ours, shape in want.items():
        if ours == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name, rule = _disk_names(ours)
        t = (torch.stack([get(name.format(e=e)).t() for e in ids]) if rule == "experts" else get(name))
        if t.numel() != shape.numel():
            raise FormatError(f"{name} holds {tuple(t.shape)}, k3-mini's {ours} needs {tuple(shape)}: the config and "
                              "the tensors disagree")
        state[ours] = t.reshape(shape)
    return state


@dataclass
class Checkpoint:
    """A read folder: its model config, our state dict (stored dtype), and whether it was K3's wrapper."""

    cfg: K3Config
    state: dict[str, torch.Tensor]
    wrapper: bool


def _skipped(name: str, cfg: K3Config) -> bool:
    """Tensors a k3-mini reader drops: multi-token prediction, the vision tower, layers past the text model's."""
    if name.startswith(("model.mtp", "mtp", "vision_tower", "vision_model", "multi_modal_projector", "mm_projector")):
        return True
    parts = name.split(".")
    return name.startswith("model.layers.") and int(parts[2]) >= cfg.num_hidden_layers


def _canonical(name: str) -> str:
    """AttnRes's other spelling, which mlx-lm's kimi_k3 also reads: ``X_res.proj_weight`` is ``X_res_proj.weight``."""
    return name.replace("_res.proj_weight", "_res_proj.weight").replace("_res.norm_weight", "_res_norm.weight")


def _files(folder: Path) -> dict[str, Path]:
    """Which shard holds each tensor (the index, or the one ``model.safetensors``)."""
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        return {k: folder / v for k, v in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FormatError(f"{folder} has neither {INDEX} nor model.safetensors: not a Hugging Face checkpoint folder")
    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping


def read_config(folder: Path) -> tuple[K3Config, bool]:
    """The folder's model config and whether it is K3's wrapper; refuses what k3-mini cannot run."""
    path = folder / "config.json"
    if not path.is_file():
        raise FormatError(f"{folder} has no config.json: point at a Hugging Face checkpoint folder")
    raw = json.loads(path.read_text())
    text = raw.get("text_config", raw)
    if text.get("model_type") != "kimi_linear":
        raise FormatError(f"{path}: model_type {text.get('model_type')!r}; k3-mini reads kimi_k3 and kimi_linear")
    quant = text.get("quantization_config") or raw.get("quantization_config")
    if quant:
        raise FormatError(f"{path} declares quantized weights ({quant.get('format', quant.get('quant_method'))}: "
                          "MXFP4-packed experts); k3-mini does not dequantise them. Dequantise the experts to bf16 "
                          "(e.g. with llm-compressor) and drop quantization_config, then read that folder")
    for key, want in (("num_expert_group", 1), ("moe_layer_freq", 1), ("mla_use_nope", True)):
        if text.get(key, want) != want:
            raise FormatError(f"{path}: {key}={text[key]!r}; k3-mini implements only {key}={want!r}")
    if text.get("q_lora_rank") is None:
        raise FormatError(f"{path}: q_lora_rank is null (a full-rank q_proj); k3-mini's MLA needs a q_lora_rank")
    return from_k3_json(path), "text_config" in raw


def read_checkpoint(folder: str | os.PathLike[str], experts: range | None = None) -> Checkpoint:
    """Read a K3 or Kimi-Linear folder into our config and state dict; ``experts``: only those routed experts (an
    expert-parallel rank's range; default all). Every tensor not skipped must be one k3-mini uses."""
    from policy.model import K3Model

    folder = Path(folder)
    cfg, wrapper = read_config(folder)
    prefix = WRAPPER if wrapper else ""
    with torch.device("meta"):
        want = {k: v.shape for k, v in K3Model(cfg).state_dict().items()}
    ids = experts if experts is not None else range(cfg.num_experts)
    if experts is not None:  # stacked expert tensors hold only this range
        want = {k: (torch.Size([len(ids), *s[1:]]) if k.startswith("layers.") and ".experts." in k else s)
                for k, s in want.items()}
    files = _files(folder)
    stored = [k for k in files if any(k.endswith(s) for s in ("weight_packed", "weight_scale"))]
    if stored:
        raise FormatError(f"{folder} holds MXFP4-packed experts ({stored[0]}); k3-mini does not dequantise them: "
                          "dequantise the experts to bf16 first")
    needed = _needed(want, cfg, ids, prefix)
    stored_as = {_canonical(k): k for k in files}
    where = {k: files[v] for k, v in stored_as.items()}
    missing = sorted(needed - where.keys())
    if missing:
        raise FormatError(f"{folder} lacks {len(missing)} tensors k3-mini needs, e.g. {missing[:3]}")
    extra = [k for k in where if k not in needed and not _skipped(k.removeprefix(prefix), cfg)
             and not _other_expert(k, cfg, ids)]
    if extra:
        raise FormatError(f"{folder} holds {len(extra)} tensors k3-mini has no place for, e.g. {extra[:3]}: "
                          "its config.json switches a part off that the weights have, or it is another model")
    with contextlib.ExitStack() as stack:  # each tensor is read when its state-dict entry is built, nothing else
        shards = {f: stack.enter_context(_Shard(f)) for f in set(where.values())}
        state = from_disk(want, lambda n: shards[where[prefix + n]].read(stored_as[prefix + n]), cfg, ids)
    return Checkpoint(cfg, state, wrapper)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class _Shard:
    """One safetensors file read tensor by tensor with plain reads (no mmap: the pages a rank touches are not its
    resident memory, so an expert-parallel rank's peak is about the tensors it keeps)."""

    def __init__(self, path: Path) -> None:
        self.f = open(path, "rb")  # noqa: SIM115 - closed by __exit__
        n = int.from_bytes(self.f.read(8), "little")
        self.header: dict[str, Any] = json.loads(self.f.read(n))
        self.start = 8 + n

    def read(self, name: str) -> torch.Tensor:
        meta = self.header[name]
        if meta["dtype"] not in _DTYPES:
            raise FormatError(f"{name} is stored as {meta['dtype']}; k3-mini reads {sorted(_DTYPES)}")
        begin, end = meta["data_offsets"]
        self.f.seek(self.start + begin)
        data = bytearray(self.f.read(end - begin))
        flat = torch.frombuffer(data, dtype=_DTYPES[meta["dtype"]]) if data else torch.empty(0, dtype=_DTYPES[meta["dtype"]])
        return flat.reshape(meta["shape"])

    def __enter__(self) -> _Shard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()


def _needed(want: dict[str, torch.Size], cfg: K3Config, ids: range, prefix: str) -> set[str]:
    """The full on-disk names of the tensors that make ``want``."""
    names: set[str] = set()
    for ours in want:
        if ours == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name, rule = _disk_names(ours)
        if rule == "experts":
            names.update(prefix + name.format(e=e) for e in ids)
        else:
            names.add(prefix + name)
    return names


def _other_expert(name: str, cfg: K3Config, ids: range) -> bool:
    """A routed expert's tensor outside ``ids`` (another expert-parallel rank's)."""
    parts = name.split(".experts.")
    return len(parts) == 2 and int(parts[1].split(".")[0]) not in ids


def check_vocab(cfg: K3Config, vocab_size: int) -> None:
    """Refuse weights whose vocabulary differs from the tokenizer's (a checkpoint brings only its weights)."""
    if cfg.vocab_size != vocab_size:
        raise FormatError(f"the checkpoint's vocabulary has {cfg.vocab_size} tokens, k3-mini's tokenizer "
                          f"{vocab_size}: k3-mini reads a checkpoint's weights, never its tokenizer (Kimi's is "
                          "tiktoken-based, 163,840 tokens). Use a checkpoint trained with k3-mini's tokenizer")


def write_checkpoint(state: dict[str, torch.Tensor], cfg: K3Config, path: str | os.PathLike[str],
                     shard_bytes: int = 2 << 30, files: Callable[[Path], None] | None = None) -> Path:
    """Write our state dict as a Kimi checkpoint folder at ``path``: sharded safetensors, the index, config.json, and
    whatever ``files(tmp)`` adds (the tokenizer's). Atomic: written as ``.tmp-NAME-PID`` beside it, fsynced, then
    renamed over any earlier folder of that name."""
    path = Path(path)
    tensors = to_disk(state, cfg)
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=1))
        if files is not None:
            files(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def load_state(path: str | os.PathLike[str], cfg: K3Config, ep: EPGroup | None = None) -> dict[str, torch.Tensor]:
    """This rank's state dict (``ep``: its routed experts only) from ``path``: a Kimi checkpoint folder (what every
    push, ``agentenv train`` and ``agentenv policy export`` write; an EP rank reads only its experts' tensors from
    the shards), or a single safetensors file under k3-mini's own names (what they wrote before; read whole)."""
    path = Path(path)
    sharded = ep is not None and ep.world > 1
    if not path.is_dir():
        if not path.is_file():
            raise FileNotFoundError(f"no checkpoint at {path}: give a Kimi checkpoint folder or a .safetensors file")
        state = load_file(str(path))
        return shard_state_dict(state, ep) if ep is not None and sharded else state
    ck = read_checkpoint(path, ep.expert_range(cfg.num_experts) if ep is not None and sharded else None)
    ids = {k: getattr(cfg, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}  # the tokenizer's, not weights
    if replace(ck.cfg, **ids) != cfg:
        differ = sorted(k for k, v in ck.cfg.to_dict().items() if cfg.to_dict()[k] != v)
        raise FormatError(f"{path} holds a different model than this one (config.json differs in {differ[:6]}): "
                          "serve it with its own config (agentenv policy serve --weights FOLDER reads FOLDER/config.json)")
    return ck.state


def tokenizer_files(max_length: int) -> Callable[[Path], None]:
    """Adds k3-mini's tokenizer to a checkpoint folder: ``tokenizer.json`` and ``tokenizer_config.json``."""
    def add(folder: Path) -> None:
        from policy.tokenizer import CACHE, load_tokenizer
        tok = load_tokenizer()
        shutil.copyfile(CACHE, folder / "tokenizer.json")
        names = {i: tok.tok.id_to_token(i) for i in (tok.bos_id, tok.eos_id, tok.pad_id)}
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": names[tok.bos_id],
            "eos_token": names[tok.eos_id], "pad_token": names[tok.pad_id], "model_max_length": max_length}, indent=1))
    return add


def save_model(state: dict[str, torch.Tensor], cfg: K3Config, path: str | os.PathLike[str]) -> Path:
    """A full model as a Kimi checkpoint folder with k3-mini's tokenizer (atomic; see ``write_checkpoint``)."""
    return write_checkpoint(state, cfg, path, files=tokenizer_files(int(cfg.max_position_embeddings)))
