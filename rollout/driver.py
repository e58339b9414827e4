"""The rollout driver: starts Ray rollout workers, hands them groups, streams trajectories as they finish.

::

    from rollout.driver import Rollout, RolloutConfig

    config = RolloutConfig("agentenv/SWE-v0", "http://127.0.0.1:8000", group_size=8)
    with Rollout(config, workers=4, out="runs/swe-1") as rollout:
        for group in rollout.groups(load_task_refs("envs/tasks/swe_tasks.jsonl")):
            ...                       # a GroupResult as soon as its G episodes are done; already in the shards

    for traj in run(tasks, "agentenv/Tool-v0", url, group_size=4, workers=2, out="runs/t"):   # the short form
        ...

**Workers** (rollout/workers.py) are Ray actors that play many groups at once with the one group player
(``rollout.groups.run_group``: reset once, ``fork(G)``, G episodes of the token-in / token-out loop), each against
its node's sandboxes; rollout/raycluster.py places them round-robin over the cluster's nodes.

**The driver** (``Rollout``) starts Ray (embedded: a local ``ray.init()`` sized to the machine; or joins
``ray_address``), starts the workers, hands out groups with backpressure (at most ``groups_per_worker`` in flight
per worker; the task iterable is read lazily) and yields each ``GroupResult`` as it finishes, after writing its
trajectories to the run folder (``rollout.trajectory.ShardWriter``; flushed at least every ``flush_interval``
seconds, so a ``kill -9`` of the driver loses only the last moments). ``workers=0`` plays in the driver's
process without Ray (debugging, unit tests).

**Faults.**

- An episode whose env or policy call fails is played again from a new fork of its group's state, at most
  ``max_retries`` times, then recorded with its finish reason (``env_error`` / ``policy_error``, reward None):
  never dropped.
- A worker that dies (killed, OOM, its node lost) is restarted by Ray (``max_restarts``); the driver sends its
  in-flight groups again (bounded by ``max_retries`` too, then recorded as ``env_error``). Every sandbox and
  snapshot a worker makes carries the labels ``agentenv.rollout.run`` and ``agentenv.rollout.worker`` (and
  sandboxes a TTL, ``sandbox_ttl``): the restarted worker first closes what its predecessor left, and at the
  end of a run the workers and then the driver sweep whatever is labelled with the run. ``sweep_run`` (also
  ``agentenv rollout cleanup``) does it by hand after the driver itself was killed. Snapshots in
  ``keep_snapshots`` are spared by every sweep (a training checkpoint's paused episodes).
- The policy server going away: the policy client's calls have timeouts; an episode whose call could not reach
  the server probes it, and when the driver's own probe fails too the run stops with ``PolicyUnavailable``
  (which names the URL), recording what finished; in-flight groups are cancelled and their sandboxes closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.config import write_json
from policy.client import PolicyClient
from rollout.groups import GroupResult, GroupSpec, failed, policy_alive
from rollout.ownership import RUN_FILE, RUN_LABEL, sweep, sweep_run
from rollout.raycluster import await_ref, init_ray, ray_errors, start_workers, worker_back
from rollout.stats import RunStats
from rollout.trajectory import ShardWriter, Trajectory
from rollout.workers import PolicyUnavailable, RolloutConfig, RolloutError, RolloutWorker, group_specs

SUMMARY_FILE = "summary.json"


# --- the driver -------------------------------------------------------------------------------------------


@dataclass
class _Slot:
    """One worker as the driver sees it."""

    key: str
    handle: Any                        # a Ray actor handle, or an in-process RolloutWorker
    inflight: int = 0
    dead: bool = False                 # Ray gave up restarting it


class Rollout:
    """The driver (see the module docstring): ``groups(tasks)`` yields ``GroupResult``; ``trajectories(tasks)``
    yields trajectories; both write the run folder ``out`` as they go. Use as a context manager, or ``close()``."""

    worker_class: type[RolloutWorker] = RolloutWorker   # what plays the groups (the training loop's plays Jobs)

    def __init__(self, config: RolloutConfig, *, workers: int = 1, out: str | os.PathLike[str] | None = None,
                 ray_address: str | None = None, run_id: str | None = None, records_per_shard: int = 64,
                 flush_interval: float = 1.0, ray_init_kwargs: dict[str, Any] | None = None,
                 probe_timeout: float = 15.0) -> None:
        if workers < 0:
            raise ValueError("workers must be >= 0 (0: play in this process, without Ray)")
        if config.group_size < 1:
            raise ValueError("group_size must be at least 1")
        self.config, self.n_workers, self.ray_address = config, workers, ray_address
        self.run_id = run_id or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        self.out = Path(out) if out is not None else None
        self.writer = ShardWriter(self.out, records_per_shard) if self.out is not None else None
        self.flush_interval, self.probe_timeout = flush_interval, probe_timeout
        self.ray_init_kwargs = dict(ray_init_kwargs or {})
        self.stats = RunStats()
        self.slots: list[_Slot] = []
        self.worker_infos: list[dict[str, Any]] = []
        self.swept: dict[str, list[str]] = {"sandboxes": [], "snapshots": []}
        self.keep_snapshots: set[str] = set()   # never swept: a training checkpoint names them (trainer/loop/partial.py)
        self.not_run = 0
        self._started_ray = False
        self._ready = False
        self._closed = False
        self._last_flush = time.monotonic()

    # ---- setup and teardown ------------------------------------------------------------------------------

    def __enter__(self) -> Rollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _preflight(self) -> None:
        c = self.config
        if c.policy_factory is not None:
            client = c.policy_factory()
        else:
            client = PolicyClient(c.policy_url, c.policy_token, c.policy_model, max_retries=2)
        try:
            if not await policy_alive(client, self.probe_timeout):
                raise PolicyUnavailable(f"the policy server at {c.policy_url} does not answer GET /v1/models; "
                                        "start it (agentenv policy serve ...) or fix --policy-url")
        finally:
            await client.aclose()

    def _write_run_file(self) -> None:
        if self.out is None:
            return
        doc = {"run_id": self.run_id, "started_at": time.time(), "workers": self.n_workers,
               "ray_address": self.ray_address, "config": self.config.to_json()}
        write_json(self.out / RUN_FILE, doc, indent=1, default=str)

    async def start(self) -> None:
        """Check the policy answers, start Ray (unless joining a running one) and the workers."""
        if self._ready:
            return
        await self._preflight()
        if self.out is not None:
            previous = self.out / RUN_FILE
            if previous.is_file() and self.config.backend_factory is None:
                # a run that was killed here may have left sandboxes behind
                with contextlib.suppress(Exception):
                    urls = [u for u in (self.config.env_urls or {}).values()]
                    await asyncio.to_thread(sweep_run, self.out, urls, self.config.env_token, self.keep_snapshots)
            self._write_run_file()
        if self.n_workers == 0:
            if self.config.env_fleet:
                raise RolloutError("env_fleet finds each node's server through Ray: it needs workers >= 1")
            w = self.worker_class(self.config, f"{self.run_id}-w0", self.run_id)
            self.slots = [_Slot(w.key, w)]
        else:
            self._start_ray_workers()   # in this thread: Ray installs its signal handlers in the main thread
        self.stats = RunStats()
        self._ready = True

    def _start_ray_workers(self) -> None:
        self._started_ray = init_ray(self.ray_address, **self.ray_init_kwargs)
        started, self.worker_infos = start_workers(self.worker_class, self.config, self.run_id, self.n_workers)
        self.slots.extend(_Slot(key, handle) for key, handle in started)

    async def _shutdown_workers(self) -> None:
        infos = []
        for s in self.slots:
            try:
                if isinstance(s.handle, RolloutWorker):
                    infos.append(await s.handle.shutdown(keep=sorted(self.keep_snapshots)))
                else:
                    infos.append(await asyncio.wait_for(await_ref(
                        s.handle.shutdown.remote(keep=sorted(self.keep_snapshots))), 90))
            except Exception as e:  # noqa: BLE001 - a dead worker: its leftovers are swept below
                infos.append({"key": s.key, "error": f"{type(e).__name__}: {e}"})
        if infos:
            self.worker_infos = infos
        if self.n_workers > 0:
            import ray

            for s in self.slots:
                with contextlib.suppress(Exception):
                    ray.kill(s.handle, no_restart=True)
        # What a dead worker left on this host or on the env servers.
        if self.config.backend_factory is None:
            urls = [u for u in (self.config.env_urls or {}).values()]
            with contextlib.suppress(Exception):
                swept = await asyncio.to_thread(sweep_run, self.run_id, urls, self.config.env_token,
                                                self.keep_snapshots)
                for k, v in swept.items():
                    self.swept[k] += v
        else:
            for s in self.slots:
                if isinstance(s.handle, RolloutWorker):
                    for k, v in sweep(s.handle.api.inner, {RUN_LABEL: self.run_id}, self.keep_snapshots).items():
                        self.swept[k] += v
        self.slots = []

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._shutdown_workers()
        finally:
            self.stats.ended = self.stats.ended or time.monotonic()
            if self.writer is not None:
                self.writer.close()
                self._write_summary()
            if self._started_ray:
                import ray

                ray.shutdown()

    def close(self) -> None:
        if not self._closed:
            asyncio.run(self.aclose())

    def summary(self) -> dict[str, Any]:
        return {"run_id": self.run_id, **self.stats.to_json(), "not_run_groups": self.not_run,
                "workers": self.worker_infos, "swept_at_end": self.swept}

    def _write_summary(self) -> None:
        if self.out is None:
            return
        write_json(self.out / SUMMARY_FILE, self.summary(), indent=1, default=str)

    # ---- the run ------------------------------------------------------------------------------------------

    def _submit(self, slot: _Slot, spec: GroupSpec) -> asyncio.Future[GroupResult]:
        slot.inflight += 1
        if isinstance(slot.handle, RolloutWorker):
            return asyncio.ensure_future(slot.handle.run_group(spec))
        return asyncio.ensure_future(await_ref(slot.handle.run_group.remote(spec)))

    def _record(self, result: GroupResult) -> None:
        if self.writer is not None:
            for t in [*result.trajectories, *result.branches]:   # a harness episode's other branches too
                self.writer.write(t)
        self.stats.add(result)

    def _maybe_flush(self, force: bool = False) -> None:
        if self.writer is not None and (force or time.monotonic() - self._last_flush >= self.flush_interval):
            self.writer.flush()
            self._last_flush = time.monotonic()

    async def stream(self, tasks: Iterable[Any]) -> AsyncGenerator[GroupResult, None]:
        """Yield each group's result as it finishes (already written to the run folder)."""
        await self.start()
        c = self.config
        errors = ray_errors()
        specs = group_specs(tasks, self.run_id, c.group_size, c.seed)
        with contextlib.suppress(TypeError):
            self.stats.groups_total = len(tasks)  # type: ignore[arg-type]
        retry: deque[tuple[GroupSpec, int]] = deque()
        inflight: dict[asyncio.Future[GroupResult], tuple[_Slot, GroupSpec, int]] = {}
        exhausted = False
        try:
            while True:
                # hand out work: retries first, then new tasks, to the least-loaded live worker with room
                while True:
                    live = [s for s in self.slots if not s.dead and s.inflight < c.groups_per_worker]
                    if not live:
                        break
                    if retry:
                        spec, attempt = retry.popleft()
                    elif not exhausted:
                        nxt = next(specs, None)
                        if nxt is None:
                            exhausted = True
                            break
                        spec, attempt = nxt, 1
                    else:
                        break
                    slot = min(live, key=lambda s: s.inflight)
                    inflight[self._submit(slot, spec)] = (slot, spec, attempt)
                if not inflight:
                    if all(s.dead for s in self.slots) and (retry or not exhausted):
                        left = len(retry) + (0 if exhausted else _count(specs))
                        if left:
                            self.not_run = left
                            raise RolloutError(f"every rollout worker died ({left} groups not played)")
                    break
                done, _ = await asyncio.wait(inflight, timeout=self.flush_interval if self.flush_interval > 0 else None,
                                             return_when=asyncio.FIRST_COMPLETED)
                self._maybe_flush()
                finished: list[GroupResult] = []
                for fut in done:  # record every finished group before yielding any (a consumer may stop early)
                    slot, spec, attempt = inflight.pop(fut)
                    slot.inflight -= 1
                    try:
                        result = fut.result()
                    except errors as e:  # the worker died (Ray restarts it): play the group again
                        self.stats.worker_failures += 1
                        if not await self._worker_alive(slot):
                            slot.dead = True
                        if attempt <= c.max_retries:
                            retry.append((dataclasses.replace(spec, attempt=attempt + 1), attempt + 1))
                            continue
                        result = _failed_group(spec, c.env_id, f"worker {slot.key} died: {type(e).__name__}: {e}",
                                               attempt)
                    except Exception as e:  # noqa: BLE001 - a bug in the worker: recorded, never dropped
                        if attempt <= c.max_retries:
                            retry.append((dataclasses.replace(spec, attempt=attempt + 1), attempt + 1))
                            continue
                        result = _failed_group(spec, c.env_id, f"worker {slot.key} failed: {type(e).__name__}: {e}",
                                               attempt)
                    self._record(result)
                    finished.append(result)
                self._maybe_flush(force=self.flush_interval <= 0)
                for result in finished:
                    if result.policy_down and not await self._policy_back():
                        self.not_run = len(inflight) + len(retry) + (0 if exhausted else _count(specs))
                        raise PolicyUnavailable(
                            f"the policy server at {c.policy_url} stopped answering ({result.error}); "
                            f"{self.stats.groups} groups recorded"
                            + (f" in {self.out}" if self.out else "")
                            + f", {self.not_run} not played")
                for result in finished:
                    yield result
        finally:
            if inflight:
                await self._cancel(inflight)
            self._maybe_flush(force=True)
            self.stats.ended = time.monotonic()

    async def _worker_alive(self, slot: _Slot) -> bool:
        """Whether a worker whose call failed answers again (Ray restarted it), or is gone for good."""
        return isinstance(slot.handle, RolloutWorker) or await worker_back(slot.handle)

    async def _policy_back(self) -> bool:
        """Whether the policy answers again within a few probes."""
        c = self.config
        client = c.policy_factory() if c.policy_factory is not None else PolicyClient(
            c.policy_url, c.policy_token, c.policy_model, max_retries=3)
        try:
            return await policy_alive(client, self.probe_timeout)
        finally:
            await client.aclose()

    async def _cancel(self, inflight: Mapping[asyncio.Future[GroupResult], Any]) -> None:
        """Cancel groups in flight; their workers close what those groups opened."""
        for fut in inflight:
            fut.cancel()
        await asyncio.wait(list(inflight), timeout=120)

    def groups(self, tasks: Iterable[Any]) -> Iterator[GroupResult]:
        """``stream`` for synchronous code (its own event loop); the run is closed when the iterator ends."""
        loop = asyncio.new_event_loop()
        agen = self.stream(tasks)
        try:
            while True:
                try:
                    result = loop.run_until_complete(agen.__anext__())
                except StopAsyncIteration:
                    break
                yield result
        finally:
            try:
                loop.run_until_complete(agen.aclose())
                loop.run_until_complete(self.aclose())
            finally:
                loop.close()

    def trajectories(self, tasks: Iterable[Any]) -> Iterator[Trajectory]:
        for result in self.groups(tasks):
            yield from result.trajectories


def _count(it: Iterator[Any]) -> int:
    return sum(1 for _ in it)


def _failed_group(spec: GroupSpec, env_id: str, error: str, attempts: int) -> GroupResult:
    trajs = [failed(spec, "env_error", error, env_id, i) for i in range(spec.group_size)]
    for t in trajs:
        t.metadata["attempt"] = attempts
    return GroupResult(spec, trajs, attempts=attempts, error=error)


def run(tasks: Iterable[Any], env_id: str, policy_url: str, group_size: int = 1, workers: int = 1,
        out: str | os.PathLike[str] | None = None, *, ray_address: str | None = None, **config: Any
        ) -> Iterator[Trajectory]:
    """Play ``tasks`` (records, ids, or None for the env's own draw) and yield trajectories as groups finish;
    ``config`` holds further ``RolloutConfig`` fields."""
    cfg = RolloutConfig(env_id, policy_url, group_size=group_size, **config)
    yield from Rollout(cfg, workers=workers, out=out, ray_address=ray_address).trajectories(tasks)
