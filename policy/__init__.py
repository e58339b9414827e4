"""The K3 policy: a k3-mini model with Kimi K3's architecture (KDA, gated MLA, Attention Residuals,
LatentMoE), an expert-parallel engine on torch.distributed, and an OpenAI-compatible server."""

from policy.config import K3Config, from_k3_json, k3_mini, preset
from policy.model import Cache, K3Model, param_counts

__all__ = ["Cache", "K3Config", "K3Model", "from_k3_json", "k3_mini", "param_counts", "preset"]
