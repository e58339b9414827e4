"""The K3 policy: a k3-mini model with Kimi K3's architecture (KDA, gated MLA, Attention Residuals,
LatentMoE), an expert-parallel engine on torch.distributed, and an OpenAI-compatible server.

The rooms: the model (``model``, ``kda``, ``mla``, ``attnres``, ``moe``, ``layers``, ``config``), the engine
(``engine``, ``ep``, ``runner``, ``prefix_cache``, ``grammar``, ``engines``), the format (``chat``,
``tokenizer``), ``server/`` (OpenAI-compatible), ``client``, ``verify`` (``agentenv policy verify``), ``cli``.

The names below load on first use, so ``from policy import chat`` (K3's chat and tool-call format,
standard library only) does not import torch, nor ``from policy import PolicyClient`` (the async client of
any OpenAI-compatible endpoint, httpx only).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from policy.client import PolicyClient
    from policy.config import K3Config, from_k3_json, k3_mini, preset
    from policy.model import Cache, K3Model, param_counts

__all__ = ["Cache", "K3Config", "K3Model", "PolicyClient", "from_k3_json", "k3_mini", "param_counts", "preset"]
_HOME = {"Cache": "policy.model", "K3Model": "policy.model", "param_counts": "policy.model",
         "K3Config": "policy.config", "from_k3_json": "policy.config", "k3_mini": "policy.config",
         "preset": "policy.config", "PolicyClient": "policy.client"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'policy' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
