"""Shared pieces of the loop's unit tests: a scripted policy whose weight version is a shared counter, a trainer and
a weight sync that only count, and a Loop wired to them with an in-process LoopRollout on fake sandboxes."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from rollout_fakes import FORKY, TOK, FakeBackend  # noqa: E402

from agentenv.config import write_atomic  # noqa: E402
from policy.client import PolicyClient  # noqa: E402
from rollout import scripted  # noqa: E402
from rollout.workers import RolloutConfig  # noqa: E402
from trainer import checkpoint as ckpt  # noqa: E402
from trainer.loop.config import load  # noqa: E402
from trainer.loop.core import Loop  # noqa: E402
from trainer.loop.rollouts import LoopRollout  # noqa: E402
from trainer.metrics import MetricsLog  # noqa: E402

__all__ = ["FORKY", "TOK", "FakeBackend", "FakeSync", "FakeTrainer", "Versions", "loop_with_fakes", "policy_factory"]


class Versions:
    """The policy's weight version (what a push bumps)."""

    def __init__(self) -> None:
        self.now = 0


Gate = Callable[[str], Awaitable[None]]


class VersionedTransport(httpx.AsyncBaseTransport):
    """The scripted app, its answers stamped with the current weight version. ``gate(prompt)``, when given, is
    awaited before a completion is answered (a test holds chosen episodes back until something happened)."""

    def __init__(self, app: Any, versions: Versions, gate: Gate | None = None) -> None:
        self.inner, self.versions, self.gate = httpx.ASGITransport(app=app), versions, gate

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.gate is not None and request.url.path.endswith("/completions"):
            await self.gate(TOK.decode(json.loads(request.content)["prompt"]))
        version = self.versions.now               # the version when the generation started
        r = await self.inner.handle_async_request(request)
        if not request.url.path.endswith("/completions"):
            return r
        body = json.loads(await r.aread())
        body["weight_version"] = version
        return httpx.Response(r.status_code, json=body)


def policy_factory(script: scripted.Script, versions: Versions, gate: Gate | None = None):
    tr = VersionedTransport(scripted.create_app(script, TOK), versions, gate)

    def make() -> PolicyClient:
        return PolicyClient("http://scripted", transport=tr, max_retries=0, backoff=0.01)

    return make


class FakeTrainer:
    """Counts steps; ``delay`` seconds per step (in the loop's training thread)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.step_count, self.delay, self.batches = 0, delay, []

    def step(self, batch: Any) -> dict[str, float]:
        time.sleep(self.delay)
        self.batches.append(batch)
        self.step_count += 1
        return {"loss": 0.0, "time/train": self.delay}

    def checkpoint(self, root: Any, data_state: dict[str, Any] | None = None, keep: int = 2,
                   files: dict[str, bytes] | None = None) -> Any:
        """A real checkpoint folder (trainer/checkpoint.py) with the loop's data state and files, no model."""
        tmp = ckpt.begin(root, self.step_count)
        for name, data in (files or {}).items():
            write_atomic(tmp / name, data, fsync=True)
        return ckpt.commit(root, self.step_count, tmp, {"data": data_state or {}}, keep)

    def close(self) -> None:
        return None


class FakeSync:
    def __init__(self, versions: Versions) -> None:
        self.versions = versions

    def push(self, trainer: Any) -> Any:
        self.versions.now += 1
        v = self.versions.now

        class Result:
            version = v

            @staticmethod
            def metrics() -> dict[str, float]:
                return {"time/sync": 0.0}

        return Result()

    def close(self) -> None:
        return None


def loop_with_fakes(tmp_path: Path, script: scripted.Script, overrides: list[str], delay: float = 0.0,
                    backend: FakeBackend | None = None, gate: Gate | None = None, resume: bool = False
                    ) -> tuple[Loop, Versions, FakeBackend]:
    """A Loop on ``test/Forky-v0`` (fake sandboxes), a scripted policy, a counting trainer and sync; no eval, no
    SWE, no warm start. Call ``await loop.rollout.start()`` before collecting."""
    cfg = load(overrides=[f'out_dir="{tmp_path}"', 'name="t"', f'env.id="{FORKY}"', 'env.train_tasks="ids:a,b,c,d"',
                          'env.heldout_tasks="ids:h1,h2"', "sft.enabled=false", "swe.enabled=false",
                          "eval.enabled=false", 'progress="off"', "ray.workers=0", *overrides])
    versions = Versions()
    backend = backend or FakeBackend()
    loop = Loop(cfg, resume=resume)
    loop.partial.api = backend
    rc = RolloutConfig(cfg.env.id, "http://scripted", backend_factory=lambda: backend,
                       policy_factory=policy_factory(script, versions, gate), tokenizer_factory=lambda: TOK)
    loop.rollout = LoopRollout(rc, workers=0, out=tmp_path / "trajectories", run_id="unit")
    loop.trainer, loop.sync = FakeTrainer(delay), FakeSync(versions)
    loop.metrics = MetricsLog(tmp_path / "metrics.jsonl")
    return loop, versions, backend


def run_iterations(loop: Loop) -> list[dict[str, Any]]:
    """Start the loop's rollout, run its RL iterations, close the rollout; the metrics rows."""
    async def go() -> None:
        await loop.rollout.start()
        try:
            await loop.iterations()
        finally:
            await loop.rollout.aclose()
    asyncio.run(go())
    return loop.metrics.rows()
