"""Training ranks as Ray actors, so that expert x data parallelism spans the nodes of a Ray cluster.

``Trainer(..., placement="ray")`` keeps rank 0 in the caller (the driver) and places ranks 1..world-1 as actors in a
placement group of one CPU (or GPU) bundle each, spread over the cluster's nodes (``SPREAD``: best effort, so a
one-node cluster works too). Every rank then runs the same loop as a spawned local rank
(``trainer.distributed.rank.serve_rank``); the process group meets on rank 0's node address, and each rank's gloo
traffic leaves by the interface holding its own node's address (``GLOO_SOCKET_IFNAME``). The caller has joined Ray (``ray.init(address=...)``) first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

RANK_START_TIMEOUT = 300.0  # seconds for the placement group's bundles to be reserved
STOP_TIMEOUT = 60.0


def node_address() -> str:
    """This process's Ray node address (the one other nodes reach it on)."""
    import ray

    return str(ray.util.get_node_ip_address())


def interface_of(address: str) -> str | None:
    """The network interface holding ``address`` (for gloo), or None where none does."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None


def use_interface_of(address: str) -> None:
    """Make gloo use the interface of ``address``: loopback for 127.x, else the one holding it."""
    name = "lo" if address.startswith("127.") else interface_of(address)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name


class RankActor:
    """One training rank in its own Ray worker process."""

    def run(self, rank: int, world: int, ep_size: int, host: str, port: int, model_cfg: dict[str, Any],
            cfg: dict[str, Any], weights: str | None, device: str, backend: str) -> None:
        """Join the process group on ``host:port`` and serve rank 0's calls until it says stop."""
        from trainer.distributed.rank import serve_rank

        use_interface_of(node_address())
        serve_rank(rank, world, ep_size, port, model_cfg, cfg, weights, device, backend, host=host,
                local_rank=0)  # Ray shows each actor only the GPU of its bundle

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())


@dataclass
class RayRanks:
    """Ranks 1..world-1 running as actors: their handles, their running loops, their placement group and the Ray
    node each runs on (in rank order)."""

    actors: list[Any]
    loops: list[Any]
    group: Any
    nodes: list[str]

    def join(self) -> None:
        """Wait for the ranks' loops to end (after rank 0 broadcast stop), then free their actors and bundles."""
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            ray.get(self.loops, timeout=STOP_TIMEOUT)
        finally:
            for a in self.actors:
                ray.kill(a)
            remove_placement_group(self.group)


def start_ranks(world: int, ep_size: int, host: str, port: int, model_cfg: dict[str, Any], cfg: dict[str, Any],
                weights: str | None, device: str, backend: str) -> RayRanks:
    """Place ranks 1..world-1 as actors (one bundle each, spread over the nodes) and start their loops."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpu = device.startswith("cuda")
    bundle = {"GPU": 1.0, "CPU": 1.0} if gpu else {"CPU": 1.0}
    group = placement_group([bundle] * (world - 1), strategy="SPREAD")
    try:
        ray.get(group.ready(), timeout=RANK_START_TIMEOUT)
    except Exception as e:
        remove_placement_group(group)
        raise TimeoutError(f"Ray could not place {world - 1} training ranks ({bundle} each) within "
                           f"{RANK_START_TIMEOUT:.0f} s ({type(e).__name__}): add nodes or lower trainer.world") from e
    remote = ray.remote(RankActor)
    actors: list[Any] = [remote.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0,
                             scheduling_strategy=PlacementGroupSchedulingStrategy(
                                 group, placement_group_bundle_index=i)).remote()
              for i in range(world - 1)]
    nodes = [str(n) for n in ray.get([a.node_id.remote() for a in actors], timeout=RANK_START_TIMEOUT)]
    loops = [a.run.remote(r, world, ep_size, host, port, model_cfg, cfg, weights, device, backend)
             for r, a in zip(range(1, world), actors, strict=True)]
    return RayRanks(actors, loops, group, nodes)
