"""Weight sync: after a step, write the weights once (safetensors, atomically) and have every policy server load them.

Each server loads it through its own reload route (``policy.reload``, with the engines' request schemas and the
versions they were read from): ours ``/update_weights``; SGLang ``/update_weights_from_disk`` with the trainer's step
as its ``weight_version``; vLLM (dev mode) ``/pause``, ``/collective_rpc`` ``reload_weights``,
``/update_weight_version`` with the step, ``/resume``. SGLang and vLLM then report the step as their version; ours
reports its own count of loads (trajectories record it).

Every push writes the same thing, whatever the servers: a checkpoint folder in the Kimi family's own Hugging Face
layout (``Trainer.save_weights``, policy/hf_format.py): sharded safetensors under the on-disk names K3's loaders
read, ``model.safetensors.index.json``, the ``config.json`` they read, and the tokenizer's files, written as a hidden
temporary folder and renamed into place, so a server never sees half a folder. Every server loads that folder.

``WeightSync.push(trainer)`` times the write and each server's load (all servers load in parallel) and returns the
new weight version(s): the version the next trajectories record. Older weight files beyond ``keep`` are removed.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from policy.reload import KINDS, Mode, reload


class Loads(Protocol):
    """An in-process engine: ``policy.engine.Engine.update_weights``."""

    def update_weights(self, path: str, mode: str = "drain", timeout: float = 600.0) -> int: ...


@dataclass(frozen=True)
class Endpoint:
    """A policy server reachable over HTTP."""

    url: str
    kind: str = "agentenv"          # "agentenv" | "sglang" | "vllm"
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown server kind {self.kind!r}; use one of {', '.join(KINDS)}")


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

    def push(self, trainer: Any) -> SyncResult:
        """Write ``trainer``'s weights (``Trainer.save_weights``: a Kimi checkpoint folder, atomic) and have every server
        load them."""
        t0 = time.perf_counter()
        step = int(trainer.step_count)
        path = trainer.save_weights(self.folder / f"step-{step:08d}")
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
        if not isinstance(e, Endpoint):
            version: int | None = e.update_weights(path, self.mode, self.timeout)
            return version, time.perf_counter() - t0
        mode: Mode = "abort" if self.mode == "abort" else "drain"
        version = reload(self.client, e.url, e.kind, path, step, mode, self.timeout, e.api_key)
        return version, time.perf_counter() - t0

    def _prune(self) -> None:
        while self.keep > 0 and len(self.written) > self.keep:
            old = self.written.pop(0)
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)

    def close(self) -> None:
        self.client.close()
