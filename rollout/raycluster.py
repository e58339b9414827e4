"""Ray for the rollout driver (rollout/driver.py): joining or starting a cluster, placing the workers over its
nodes, awaiting their calls, and telling a worker Ray is restarting from one that is gone.

Workers are Ray actors with a fractional CPU (``RolloutConfig.worker_cpus``), placed round-robin over the
cluster's live nodes with CPUs (a soft node affinity), restarted by Ray up to ``max_restarts`` times; with
``env_fleet`` each node's env server of the fleet is found here, before the workers take the config.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from typing import Any

from rollout.workers import RolloutConfig, RolloutError, RolloutWorker

WORKER_BACK_TIMEOUT = 180.0  # seconds a killed worker has to answer again once Ray restarts it


def ray_errors() -> tuple[type[BaseException], ...]:
    """Ray's errors that mean a worker (or its node) died: its group is played again elsewhere."""
    try:
        from ray import exceptions as rex
    except ImportError:
        return ()
    errs: list[type[BaseException]] = [rex.RayActorError]
    for name in ("ActorUnavailableError", "ActorDiedError", "WorkerCrashedError", "NodeDiedError",
                 "OwnerDiedError", "ObjectLostError"):
        if hasattr(rex, name):
            errs.append(getattr(rex, name))
    return tuple(errs)


def init_ray(address: str | None, **overrides: Any) -> bool:
    """Join the Ray cluster at ``address``, or start a Ray of our own sized to this machine (None); nothing if
    this process already joined one. True if it joined here (then the caller shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                          "logging_level": logging.WARNING, "configure_logging": False}
    if address is None:
        kw["num_cpus"] = os.cpu_count() or 1
        kw["object_store_memory"] = 256 << 20
    # "local": a new Ray of our own, even when another one runs on this machine (None would join it)
    ray.init(address=address or "local", **{**kw, **overrides})
    return True


def start_workers(worker_class: type[RolloutWorker], config: RolloutConfig, run_id: str, n: int
                  ) -> tuple[list[tuple[str, Any]], list[dict[str, Any]]]:
    """``n`` workers placed over the cluster's nodes (Ray is initialised): their (key, actor handle), and the
    ``info()`` each answered once started. Call it in the main thread: Ray installs its signal handlers there."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if config.env_fleet:  # the fleet's server of each node, before the workers take the config
        from agentenv.remote import fleet

        found = fleet.urls()
        if not found:
            raise RolloutError("env_fleet: no env server of the fleet answers on this Ray cluster; run "
                               "`agentenv cluster up` first")
        config.env_urls = {**found, **(config.env_urls or {})}
    nodes = [node for node in ray.nodes() if node.get("Alive") and node.get("Resources", {}).get("CPU", 0) > 0]
    if not nodes:
        raise RolloutError("the Ray cluster has no live node with CPUs")
    per_node = Counter(i % len(nodes) for i in range(n))
    remote = ray.remote(worker_class)
    started: list[tuple[str, Any]] = []
    for i in range(n):
        node = nodes[i % len(nodes)]
        cpus = min(config.worker_cpus, node["Resources"]["CPU"] / per_node[i % len(nodes)])
        key = f"{run_id}-w{i}"
        handle = remote.options(
            name=f"rollout-{key}", num_cpus=cpus, max_restarts=config.max_restarts, max_task_retries=0,
            max_concurrency=1000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=True),
        ).remote(config, key, run_id)
        started.append((key, handle))
    try:
        infos = ray.get([handle.info.remote() for _, handle in started], timeout=300)
    except Exception as e:  # noqa: BLE001 - reported as one clear error
        raise RolloutError(f"the rollout workers did not start: {type(e).__name__}: {e}") from e
    return started, list(infos)


async def await_ref(ref: Any) -> Any:
    """Await a Ray ObjectRef; cancelling this cancels the remote call."""
    try:
        return await ref
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            import ray

            ray.cancel(ref)
        raise


async def worker_back(handle: Any) -> bool:
    """Whether a Ray worker whose call failed answers again (Ray restarted it), or is gone for good."""
    import ray.exceptions as rex

    unavailable = getattr(rex, "ActorUnavailableError", ())  # restarting: a call now fails at once
    deadline = time.monotonic() + WORKER_BACK_TIMEOUT
    while True:
        try:
            await asyncio.wait_for(await_ref(handle.info.remote()), max(1.0, deadline - time.monotonic()))
            return True
        except unavailable:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.5)  # Ray is still restarting it: ask again
        except Exception:  # noqa: BLE001 - dead for good, or not back in time: no more groups for it
            return False
