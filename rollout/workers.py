"""Ray rollout workers: a ``RolloutWorker`` plays many groups at once on one asyncio loop; what to play is a
``RolloutConfig``. The driver that starts them and streams their trajectories is ``rollout.driver.Rollout``
(its module doc tells the whole path, faults included).

**Workers.** ``RolloutWorker`` is a Ray actor with a fractional CPU (``worker_cpus``) that plays many groups at
once on one asyncio loop (``rollout.groups.run_group``: reset once, ``fork(G)``, G episodes of the token-in /
token-out loop); env calls run in its threads, policy calls share one ``PolicyClient``. Each makes its envs in
its own process (``gymnasium.make(env_id, api=...)``) against its node's sandboxes: the ``agentenv serve`` that
``env_urls`` names for its node (by Ray node id, node IP, or ``"*"``; ``env_fleet``: the fleet's server of
its node, ``agentenv.remote.fleet``), else the one ``$AGENTENV_URL`` names on
that node (token: ``env_token`` or ``$AGENTENV_TOKEN``), else local sandboxes on the node itself. Everything it
makes carries the run's labels (``rollout.ownership``).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from envs.protocol import GymEnv
from policy.client import PolicyClient
from rollout.agent import AgentConfig, LocalTokenizer, Tokenizer
from rollout.groups import GroupResult, GroupSpec, run_group
from rollout.harnesses import GatewayServer, HarnessConfig, HarnessDriver
from rollout.ownership import (
    LOCAL,
    RUN_LABEL,
    WORKER_LABEL,
    LabelledBackend,
    connect,
    node_env_url,
    sweep,
)
from rollout.pausing import Partial


class RolloutError(RuntimeError):
    """A run that cannot go on (no worker could start, every worker died, ...)."""


class PolicyUnavailable(RolloutError):
    """The policy server stopped answering (or never did)."""


@dataclass
class RolloutConfig:
    """What to play and how: the env, the policy, groups, retries, and where sandboxes live."""

    env_id: str
    policy_url: str
    policy_token: str | None = None
    policy_model: str | None = None
    group_size: int = 1
    memory_fork: bool = False                 # fork processes too (CRIU), not only files
    agent: AgentConfig = field(default_factory=AgentConfig)
    env_kwargs: dict[str, Any] = field(default_factory=dict)   # gymnasium.make(env_id, **env_kwargs)
    env_urls: dict[str, str] | None = None    # node id / node IP / "*" -> agentenv serve URL (or "local")
    env_token: str | None = None
    env_fleet: bool = False                   # env_urls from the Ray cluster's fleet (agentenv cluster up)
    max_retries: int = 2                      # per episode, and per group for a worker that died
    groups_per_worker: int = 4                # backpressure: groups in flight per worker
    worker_cpus: float = 0.5
    max_restarts: int = 4                     # Ray restarts of a dead worker
    threads: int = 64                         # env calls at once per worker
    sandbox_ttl: float | None = 4 * 3600.0    # a backstop for sandboxes whose worker vanished
    seed: int | None = 0                      # group i resets with seed + i
    keep_messages: bool = False               # store the conversation as messages too (for people)
    policy_concurrency: int = 256
    harness: HarnessConfig | None = None      # episodes played by an agent harness through the gateway
    # In-process hooks (workers=0, tests): where sandboxes live, the policy client, the tokenizer.
    backend_factory: Callable[[], Any] | None = None
    policy_factory: Callable[[], PolicyClient] | None = None
    tokenizer_factory: Callable[[], Tokenizer] = LocalTokenizer

    def to_json(self) -> dict[str, Any]:
        """The settings worth keeping with a run (no tokens, no in-process hooks)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if not f.name.endswith(("_factory", "_token"))}
        out["agent"] = asdict(self.agent)
        out["harness"] = asdict(self.harness) if self.harness is not None else None
        return out


# --- the worker ------------------------------------------------------------------------------------------


def _ray_node() -> tuple[str | None, str | None, bool]:
    """(node id, node IP, whether Ray restarted this actor) — Nones outside Ray."""
    try:
        import ray

        if not ray.is_initialized():
            return None, None, False
        ctx = ray.get_runtime_context()
        restarted = False
        with contextlib.suppress(Exception):
            restarted = bool(ctx.was_current_actor_reconstructed)
        return ctx.get_node_id(), ray.util.get_node_ip_address(), restarted
    except ImportError:
        return None, None, False


class RolloutWorker:
    """Plays groups (``run_group``) many at once; a Ray actor (``ray.remote(RolloutWorker)``) or in-process."""

    def __init__(self, config: RolloutConfig, key: str, run_id: str) -> None:
        self.config, self.key, self.run_id = config, key, run_id
        self.node_id, self.node_ip, self.restarted = _ray_node()
        self.env_url = LOCAL
        if config.backend_factory is not None:
            base = config.backend_factory()
        else:
            if config.env_fleet and self.node_id not in (config.env_urls or {}):
                raise RolloutError(f"node {self.node_id} has no env server of the fleet: run `agentenv cluster "
                                   "up` again (it starts one on every node)")
            url = node_env_url(config.env_urls, self.node_id, self.node_ip)
            base = connect(url, config.env_token)
            self.env_url = url or LOCAL
        # A worker Ray restarted first closes the sandboxes its predecessor (same key) left behind; not its
        # snapshots: paused episodes the driver holds (partial rollouts) live in them. The run's end sweeps those.
        self.swept = sweep(base, {RUN_LABEL: run_id, WORKER_LABEL: key}, snapshots=False)
        self.api = LabelledBackend(base, {RUN_LABEL: run_id, WORKER_LABEL: key}, config.sandbox_ttl)
        self.tokenizer = config.tokenizer_factory()
        self._policy: PolicyClient | None = None
        self._gateway: GatewayServer | None = None
        self._running = 0
        self.groups_done = 0

    def info(self) -> dict[str, Any]:
        return {"key": self.key, "pid": os.getpid(), "node_id": self.node_id, "node_ip": self.node_ip,
                "env_url": self.env_url, "restarted": self.restarted, "swept": self.swept,
                "groups_done": self.groups_done, "running": self._running}

    def _policy_client(self) -> PolicyClient:
        if self._policy is None:
            c = self.config
            if c.policy_factory is not None:
                self._policy = c.policy_factory()
            else:
                self._policy = PolicyClient(c.policy_url, c.policy_token, c.policy_model, timeout=c.agent.policy_timeout,
                                            max_retries=2, max_concurrency=c.policy_concurrency)
            loop = asyncio.get_running_loop()
            loop.set_default_executor(ThreadPoolExecutor(max_workers=c.threads, thread_name_prefix="rollout-env"))
        return self._policy

    def make_env(self) -> GymEnv:
        import gymnasium

        import envs  # noqa: F401  (registers the env ids)

        return gymnasium.make(self.config.env_id, api=self.api, **self.config.env_kwargs)

    @property
    def running(self) -> int:
        """The groups this worker is playing now."""
        return self._running

    async def run_group(self, spec: GroupSpec) -> GroupResult:
        c = self.config
        return await self.play(spec, self.make_env, c.agent, env_id=c.env_id, memory=c.memory_fork)

    async def play(self, spec: GroupSpec, make_env: Callable[[], GymEnv], agent: AgentConfig, *, env_id: str,
                   memory: bool, metadata: dict[str, Any] | None = None, partial: Partial | None = None,
                   harness: HarnessConfig | None = None) -> GroupResult:
        """Play a group with ``run_group`` (retries, the probe, pause and resume), this worker's policy client and
        the run's retry and message settings; ``metadata`` goes into each trajectory's. ``harness`` (else the run's):
        the episodes are played by that agent harness through this worker's gateway."""
        policy = self._policy_client()
        self._running += 1
        try:
            meta = {**(metadata or {}), "worker": self.key, "node_id": self.node_id, "env_url": self.env_url}
            c = self.config
            result = await run_group(make_env, spec, policy, self.tokenizer, agent, memory=memory, env_id=env_id,
                                     max_retries=c.max_retries, keep_messages=c.keep_messages, metadata=meta,
                                     partial=partial, harness=self._harness_driver(harness or c.harness))
            result.info.update(worker=self.key)
            return result
        finally:
            self._running -= 1
            self.groups_done += 1

    def _harness_driver(self, harness: HarnessConfig | None) -> HarnessDriver | None:
        """``harness`` with this worker's gateway (started on first use), or None."""
        if harness is None:
            return None
        if self._gateway is None:
            from policy.tokenizer import load_tokenizer  # the gateway renders with the engine's: k3-mini's

            self._gateway = GatewayServer(self.config.policy_url, self.config.policy_token, load_tokenizer())
        return HarnessDriver(self._gateway, harness)

    async def shutdown(self, wait: float = 60.0, keep: list[str] | None = None) -> dict[str, Any]:
        """Wait (up to ``wait`` seconds) for groups still closing (cancelled ones), close the policy client and
        anything still labelled with this worker but the snapshots in ``keep``; returns ``info()``."""
        deadline = time.monotonic() + wait
        while self._running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._policy is not None:
            with contextlib.suppress(Exception):
                await self._policy.aclose()
            self._policy = None
        if self._gateway is not None:
            await asyncio.to_thread(self._gateway.close)
            self._gateway = None
        left = await asyncio.to_thread(sweep, self.api.inner, {RUN_LABEL: self.run_id, WORKER_LABEL: self.key},
                                       keep or ())
        info = self.info()
        info["left_at_shutdown"] = left
        return info


# --- what a run did ---------------------------------------------------------------------------------------


# --- tasks ------------------------------------------------------------------------------------------------


def load_task_refs(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Task records from a JSONL file (one a line), a JSON list, or a Parquet file or folder (a dataset as the
    Hugging Face hub publishes it: ``envs.datasets``), as plain JSON values, passed to
    ``reset(options={"task": ...})`` as they are (each env reads its own records)."""
    from envs.datasets import SourceError, read_records

    try:
        records = [r for _, r in read_records(Path(path))]
    except SourceError as e:
        raise RolloutError(str(e)) from None
    if not all(isinstance(r, dict) for r in records):
        raise RolloutError(f"{path}: every task must be a JSON object")
    return records


def task_id_of(task: Any) -> str:
    if isinstance(task, Mapping):
        from envs.datasets import record_id

        return record_id(task)  # its instance_id (R2E-Gym's rows get theirs from the repository and commit)
    return "" if task is None else str(getattr(task, "instance_id", None) or getattr(task, "id", None) or task)


def group_specs(tasks: Iterable[Any], run_id: str, group_size: int, seed: int | None) -> Iterator[GroupSpec]:
    """One ``GroupSpec`` per task (a record, an id, a GroupSpec, or None for the env's own draw)."""
    for i, task in enumerate(tasks):
        if isinstance(task, GroupSpec):
            yield task
            continue
        yield GroupSpec(group_id=f"{run_id}-g{i:05d}", task=task, task_id=task_id_of(task), group_size=group_size,
                        seed=None if seed is None else seed + i, index=i)
