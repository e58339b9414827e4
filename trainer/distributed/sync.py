"""Weight sync: after a step, write the weights once (safetensors, atomically) and have every policy server load them.

Per kind of server (the same calls as ``policy.engines.reload_weights``):

    agentenv (ours)   POST /update_weights            {"path": FILE, "mode": "drain" | "abort"}
                      -> {"ok": true, "weight_version": N}   (N: the server's count of loads; trajectories record it)
    SGLang            POST /update_weights_from_disk  {"model_path": DIR, "weight_version": "N", ...}
                      -> {"success": bool, "message": str}
    vLLM (dev mode)   POST /collective_rpc            {"method": "reload_weights", "kwargs": {"weights_path": DIR}}

External engines load a checkpoint folder in the Hugging Face layout, so for them a push writes one
(``write_hf_dir``): ``config.json`` (K3's field names, ``policy.config.from_k3_json`` reads it back),
``model.safetensors`` (the trainer's tensors, under k3-mini's own names), ``tokenizer.json`` and
``tokenizer_config.json``, written into a hidden temporary folder and renamed into place, so a server never sees
half a folder. Our server (and an in-process ``policy.engine.Engine``, or anything with
``update_weights(path) -> version``) loads a single file: the folder's ``model.safetensors`` when a folder was
written, else ``step-N.safetensors`` alone.

``WeightSync.push(trainer)`` times the write and each server's load (all servers load in parallel) and returns the
new weight version(s): the version the next trajectories record. Older weight files beyond ``keep`` are removed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx


class Loads(Protocol):
    """An in-process engine: ``policy.engine.Engine.update_weights``."""

    def update_weights(self, path: str, mode: str = "drain", timeout: float = 600.0) -> int: ...


@dataclass(frozen=True)
class Endpoint:
    """A policy server reachable over HTTP."""

    url: str
    kind: str = "agentenv"          # "agentenv" | "sglang" | "vllm"
    api_key: str | None = None

    def request(self, path: str, version: int) -> tuple[str, dict[str, Any]]:
        """The route and body that make this server load ``path``."""
        if self.kind == "agentenv":
            return "/update_weights", {"path": path}
        if self.kind == "sglang":
            return "/update_weights_from_disk", {"model_path": path, "weight_version": str(version)}
        if self.kind == "vllm":
            return "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}}
        raise ValueError(f"unknown server kind {self.kind!r}; use agentenv, sglang or vllm")


def hf_config(cfg: Any) -> dict[str, Any]:
    """A ``policy.config.K3Config`` as a Hugging Face ``config.json`` with Kimi K3's field names (the inverse of
    ``policy.config.from_k3_json``)."""
    d = cfg.to_dict()
    linear = {"kda_layers": list(d.pop("kda_layers")), "full_attn_layers": list(d.pop("full_attn_layers")),
              "num_heads": d.pop("linear_num_heads"), "head_dim": d.pop("linear_head_dim"),
              "short_conv_kernel_size": d.pop("short_conv_kernel_size"),
              "gate_lower_bound": d.pop("gate_lower_bound"), "chunk_size": d.pop("kda_chunk_size")}
    return {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "torch_dtype": "float32",
            **d, "linear_attn_config": linear, "hidden_act": "situ", "mla_use_nope": True,
            "mla_use_output_gate": True, "moe_router_activation_func": "sigmoid"}


def write_hf_dir(trainer: Any, path: Path) -> Path:
    """``trainer``'s weights as a Hugging Face model folder at ``path`` (see the module docstring); atomic: written
    as ``.tmp-NAME-PID`` beside it, then renamed over any earlier folder of that name."""
    from policy.tokenizer import CACHE, load_tokenizer

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        trainer.save_weights(tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(hf_config(trainer.model_cfg), indent=1))
        tok = load_tokenizer()
        shutil.copyfile(CACHE, tmp / "tokenizer.json")
        names = {i: tok.tok.id_to_token(i) for i in (tok.bos_id, tok.eos_id, tok.pad_id)}
        (tmp / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": names[tok.bos_id],
            "eos_token": names[tok.eos_id], "pad_token": names[tok.pad_id],
            "model_max_length": int(trainer.model_cfg.max_position_embeddings)}, indent=1))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


class SyncError(RuntimeError):
    """One or more servers did not load the new weights."""


@dataclass
class SyncResult:
    """What one push did: the file, the step it holds, and how long writing and each server's load took."""

    path: str
    step: int
    write_s: float
    load_s: dict[str, float] = field(default_factory=dict)
    versions: dict[str, int | None] = field(default_factory=dict)   # per server: the version it reports now
    total_s: float = 0.0

    @property
    def version(self) -> int | None:
        """The new weight version, when every server that reports one agrees (else None)."""
        vs = {v for v in self.versions.values() if v is not None}
        return vs.pop() if len(vs) == 1 else None

    def metrics(self) -> dict[str, float]:
        return {"time/sync": self.total_s, "sync/write_s": self.write_s,
                "sync/load_s": max(self.load_s.values(), default=0.0)}


class WeightSync:
    """Pushes a trainer's weights to policy servers (see the module docstring)."""

    def __init__(self, endpoints: Sequence[Endpoint | Loads], folder: str, keep: int = 2, timeout: float = 600.0,
                 mode: str = "drain", client: httpx.Client | None = None) -> None:
        """``mode`` (ours): "drain" lets running sequences finish on the old weights, "abort" ends them now."""
        self.endpoints = list(endpoints)
        self.folder = Path(folder)
        self.keep, self.timeout, self.mode = keep, timeout, mode
        self.client = client or httpx.Client(timeout=timeout)
        self.written: list[Path] = []
        # an external engine (vLLM, SGLang) among the servers: pushes write Hugging Face folders
        self.external = any(isinstance(e, Endpoint) and e.kind != "agentenv" for e in self.endpoints)

    def push(self, trainer: Any) -> SyncResult:
        """Write ``trainer``'s weights (``Trainer.save_weights``, atomic) and have every server load them."""
        t0 = time.perf_counter()
        step = int(trainer.step_count)
        if self.external:
            path = write_hf_dir(trainer, self.folder / f"step-{step:08d}")
        else:
            path = self.folder / f"step-{step:08d}.safetensors"
            trainer.save_weights(path)
        write_s = time.perf_counter() - t0
        result = self.load(str(path), step)
        result.write_s = write_s
        result.total_s = time.perf_counter() - t0
        self.written = [p for p in self.written if p != path] + [path]   # a step pushed again: one file
        self._prune()
        return result

    def load(self, path: str, step: int = 0) -> SyncResult:
        """Have every server load ``path`` (in parallel); raises SyncError naming each server that failed."""
        result = SyncResult(path, step, 0.0)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, len(self.endpoints))) as pool:
            futures = [(self._name(e), pool.submit(self._load_one, e, path, step)) for e in self.endpoints]
            errors = []
            for name, fut in futures:
                try:
                    result.versions[name], result.load_s[name] = fut.result()
                except Exception as e:  # noqa: BLE001 - collected, raised together below
                    errors.append(f"{name}: {type(e).__name__}: {e}")
        result.total_s = time.perf_counter() - t0
        if errors:
            raise SyncError("weight sync failed on " + "; ".join(errors))
        return result

    @staticmethod
    def _name(e: Endpoint | Loads) -> str:
        return e.url if isinstance(e, Endpoint) else f"local:{id(e):x}"

    def _load_one(self, e: Endpoint | Loads, path: str, step: int) -> tuple[int | None, float]:
        t0 = time.perf_counter()
        if Path(path).is_dir() and not (isinstance(e, Endpoint) and e.kind != "agentenv"):
            path = str(Path(path) / "model.safetensors")   # ours loads the folder's one file
        if not isinstance(e, Endpoint):
            version: int | None = e.update_weights(path, self.mode, self.timeout)
            return version, time.perf_counter() - t0
        route, body = e.request(path, step)
        if e.kind == "agentenv":
            body["mode"] = self.mode
        headers = {"Authorization": f"Bearer {e.api_key}"} if e.api_key else {}
        r = self.client.post(e.url.rstrip("/") + route, json=body, headers=headers, timeout=self.timeout)
        if r.status_code >= 400:
            raise SyncError(f"HTTP {r.status_code}: {r.text[:300]}")
        data = r.json() if r.content else {}
        if isinstance(data, dict) and data.get("success") is False:
            raise SyncError(str(data.get("message", "the server refused the weights")))
        version = data.get("weight_version") if isinstance(data, dict) else None
        if e.kind == "sglang":
            version = step
        return (int(version) if version is not None else None), time.perf_counter() - t0

    def _prune(self) -> None:
        while self.keep > 0 and len(self.written) > self.keep:
            old = self.written.pop(0)
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)

    def close(self) -> None:
        self.client.close()
