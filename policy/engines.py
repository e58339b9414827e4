"""Serving real Kimi K3 on vLLM or SGLang with expert parallelism: command lines, start, health check,
weight reload (policy/reload.py), and a client smoke check that works the same against our own k3-mini server.

Command lines are built, not guessed at run time, so they are unit-tested; the API key goes in the
environment (vLLM reads ``VLLM_API_KEY``) or, for SGLang, its ``--api-key`` flag.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from policy.reload import reload


@dataclass
class EngineSpec:
    """How to serve a K3 checkpoint: engine kind, model path, parallel sizes, bind address and key."""

    kind: str                      # "vllm" | "sglang" | "agentenv" (our k3-mini server)
    model: str                     # local checkpoint folder or hub id; a preset name for "agentenv"
    served_model_name: str = "kimi-k3"
    host: str = "127.0.0.1"
    port: int = 8000
    tensor_parallel_size: int = 8
    data_parallel_size: int = 1
    expert_parallel: bool = True
    max_model_len: int | None = None
    api_key: str | None = None
    extra_args: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def vllm_command(spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
    """``vllm serve`` with DP+EP for K3 and the ``kimi_k3`` tool and reasoning parsers."""
    cmd = ["vllm", "serve", spec.model, "--served-model-name", spec.served_model_name,
           "--host", spec.host, "--port", str(spec.port), "--trust-remote-code",
           "--tensor-parallel-size", str(spec.tensor_parallel_size),
           "--data-parallel-size", str(spec.data_parallel_size),
           "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k3", "--reasoning-parser", "kimi_k3"]
    if spec.expert_parallel:
        cmd.append("--enable-expert-parallel")
    if spec.max_model_len:
        cmd += ["--max-model-len", str(spec.max_model_len)]
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # exposes /collective_rpc, used to reload weights
    if spec.api_key:
        env["VLLM_API_KEY"] = spec.api_key
    return cmd + spec.extra_args, env


def sglang_command(spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
    """``sglang.launch_server`` with TP, DP attention and EP over the same GPUs for K3."""
    gpus = spec.tensor_parallel_size * spec.data_parallel_size
    cmd = ["python", "-m", "sglang.launch_server", "--model-path", spec.model,
           "--served-model-name", spec.served_model_name, "--host", spec.host, "--port", str(spec.port),
           "--trust-remote-code", "--tp-size", str(gpus), "--tool-call-parser", "kimi_k3",
           "--reasoning-parser", "kimi_k3"]
    if spec.data_parallel_size > 1:
        cmd += ["--dp-size", str(spec.data_parallel_size), "--enable-dp-attention"]
    if spec.expert_parallel:
        cmd += ["--ep-size", str(gpus)]
    if spec.max_model_len:
        cmd += ["--context-length", str(spec.max_model_len)]
    if spec.api_key:
        cmd += ["--api-key", spec.api_key]
    return cmd + spec.extra_args, {}


def agentenv_command(spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
    """Our own server (``agentenv policy serve``), one EP rank per data-parallel rank; token via env."""
    cmd = [sys.executable, "-m", "policy.cli", "serve", "--preset", spec.model, "--ep", str(spec.data_parallel_size),
           "--host", spec.host, "--port", str(spec.port)]
    if spec.max_model_len:
        cmd += ["--max-context", str(spec.max_model_len)]
    return cmd + spec.extra_args, ({"AGENTENV_POLICY_TOKEN": spec.api_key} if spec.api_key else {})


def build_command(spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
    """The argv and extra environment that serve ``spec``."""
    builders = {"vllm": vllm_command, "sglang": sglang_command, "agentenv": agentenv_command}
    if spec.kind not in builders:
        raise ValueError(f"unknown engine {spec.kind!r}; use one of {sorted(builders)}")
    return builders[spec.kind](spec)


def start(spec: EngineSpec) -> subprocess.Popen[bytes]:
    """Launch the engine as a child process (its output goes to ours)."""
    cmd, env = build_command(spec)
    return subprocess.Popen(cmd, env={**os.environ, **env})


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def wait_healthy(base_url: str, timeout: float = 600.0, interval: float = 1.0) -> None:
    """Poll ``GET /health`` until it answers 200 (vLLM, SGLang and our server all serve it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url} did not become healthy within {timeout:.0f}s")
        time.sleep(interval)


def reload_weights(spec: EngineSpec, path: str, version: int, timeout: float = 3600.0) -> int:
    """Ask a running engine to load the checkpoint folder ``path`` as weight version ``version`` through its own
    reload route (``policy.reload``: SGLang's /update_weights_from_disk, vLLM's dev-mode /collective_rpc
    ``reload_weights``, ours /update_weights); returns the version it now reports."""
    with httpx.Client() as client:
        return reload(client, spec.base_url, spec.kind, path, version, timeout=timeout, api_key=spec.api_key)


def smoke_check(base_url: str, api_key: str | None, model: str) -> dict[str, Any]:
    """The same client code for any OpenAI-compatible K3 endpoint: list models, one short chat turn."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key=api_key or "none")
    ids = [m.id for m in client.models.list().data]
    if model not in ids:
        raise RuntimeError(f"{model!r} is not served at {base_url} (serves {ids})")
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                       max_tokens=4, temperature=0)
    return {"models": ids, "finish_reason": r.choices[0].finish_reason, "content": r.choices[0].message.content}
