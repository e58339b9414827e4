"""A Trainer's ranks 1..world-1 as Ray actors (``Trainer(..., ranks="ray")``) instead of processes spawned here: one
placement-group bundle a rank, spread over the cluster's nodes, each joining rank 0 (the caller's process) over
gloo / NCCL at rank 0's node address, so the EP x DP job can outgrow one machine.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
READY_TIMEOUT = 300.0     # seconds the placement group has to be placed


class RankActor:
    """One training rank in a Ray actor: ``run`` is the worker loop (``trainer.rank._worker``) until rank 0 stops it."""

    def node(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def run(self, *args: Any) -> None:
        from trainer.rank import _worker

        _worker(*args)


class RayRanks:
    """Ranks 1..``world``-1 on the Ray cluster this process is a driver of; ``addr`` is where rank 0 listens."""

    def __init__(self, world: int, cpus: float = 1.0, gpus: float = 0.0, strategy: str = "SPREAD") -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"placement strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
        try:
            import ray
            from ray.util.placement_group import placement_group
        except ImportError as e:
            raise ValueError(f"ranks='ray' needs Ray ({e}): pip install 'agentenv[rl]'") from None
        if not ray.is_initialized():
            raise ValueError("ranks='ray' runs the ranks on the Ray cluster this process joined: call ray.init first")
        self.ray = ray
        self.addr = ray.util.get_node_ip_address()
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        self.pg = placement_group([bundle] * (world - 1), strategy=strategy)
        self.actors: list[Any] = []
        self.refs: list[Any] = []
        try:
            ray.get(self.pg.ready(), timeout=READY_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - one clear error, the group removed
            self.close()
            raise ValueError(f"the cluster cannot place {world - 1} ranks of {bundle} ({strategy}): {e}") from None
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = ray.remote(RankActor)
        self.actors = [remote.options(num_cpus=cpus, num_gpus=gpus, max_restarts=0, scheduling_strategy=(
            PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i))).remote()
            for i in range(world - 1)]
        self.nodes = [ray.get(a.node.remote(), timeout=READY_TIMEOUT) for a in self.actors]

    def start(self, args: list[tuple[Any, ...]]) -> None:
        """Start each actor's worker loop with its rank's arguments (they rendezvous with rank 0 next)."""
        self.refs = [a.run.remote(*x) for a, x in zip(self.actors, args, strict=True)]

    def join(self, timeout: float = 30.0) -> None:
        """Wait for the worker loops (after rank 0 sent stop), then remove the actors and the placement group."""
        try:
            if self.refs:
                self.ray.get(self.refs, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - the actors go either way
            log.warning("a Ray training rank did not stop cleanly: %s: %s", type(e).__name__, e)
        self.close()

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            self.ray.kill(a, no_restart=True)
        self.actors = []
        remove_placement_group(self.pg)
