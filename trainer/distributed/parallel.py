"""Process groups for training: expert parallelism (``policy/ep.py``) inside groups of ``ep_size`` ranks, data
parallelism across all ranks.

``world`` ranks form ``world / ep_size`` expert-parallel groups of consecutive ranks; each group holds every routed
expert once (rank r of a group holds the experts ``EPGroup.expert_range``), and every rank runs the dense parts on
its own samples. Gradients are summed: replicated parameters over all ranks, a routed expert's parameters over the
ranks that hold the same shard (one per EP group), since an expert already receives every token routed to it from
its whole EP group through the all-to-all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from policy.ep import EPGroup


@dataclass(frozen=True)
class Layout:
    """Where a rank sits: its EP group (for the MoE all-to-alls) and the group it shares expert shards with."""

    rank: int = 0
    world: int = 1
    ep_size: int = 1
    ep: EPGroup = EPGroup()
    expert_dp_group: Any = None      # ranks holding the same expert shard (None: the default group, or nobody)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def expert_dp_size(self) -> int:
        return self.world // self.ep_size


def init_layout(rank: int, world: int, ep_size: int, port: int, backend: str, host: str = "127.0.0.1") -> Layout:
    """Join the ``world``-rank default group on ``host:port`` (rank 0's address) and make the EP and expert-DP
    subgroups (every rank creates every subgroup, in the same order, as torch.distributed requires)."""
    if world % ep_size:
        raise ValueError(f"ep_size {ep_size} does not divide the world size {world}")
    if world == 1:
        return Layout()
    if host.startswith("127."):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world)
    ep_group: Any = None
    if 1 < ep_size < world:
        for g in range(world // ep_size):
            grp = dist.new_group(list(range(g * ep_size, (g + 1) * ep_size)))
            if rank // ep_size == g:
                ep_group = grp
    expert_dp: Any = None
    if ep_size == 1:
        expert_dp = None                     # every rank holds every expert: the default group
    elif ep_size < world:
        for e in range(ep_size):
            grp = dist.new_group(list(range(e, world, ep_size)))
            if rank % ep_size == e:
                expert_dp = grp
    ep = EPGroup(rank % ep_size, ep_size, ep_group) if ep_size > 1 else EPGroup()
    return Layout(rank, world, ep_size, ep, expert_dp)


def all_reduce_grads(model: torch.nn.Module, layout: Layout) -> None:
    """Sum gradients across ranks: replicated parameters over the world, routed experts over their expert-DP group."""
    if not layout.distributed:
        return
    dense = [p.grad for n, p in model.named_parameters() if ".experts." not in n and p.grad is not None]
    experts = [p.grad for n, p in model.named_parameters() if ".experts." in n and p.grad is not None]
    _reduce_flat(dense, None)
    if layout.ep_size == 1:
        _reduce_flat(experts, None)
    elif layout.expert_dp_size > 1:
        _reduce_flat(experts, layout.expert_dp_group)


def _reduce_flat(grads: list[torch.Tensor], group: Any) -> None:
    """One all-reduce over the concatenation of ``grads`` (fewer, larger messages)."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    off = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[off:off + n].view_as(g))
        off += n


def grad_norm(model: torch.nn.Module, layout: Layout) -> torch.Tensor:
    """The global L2 norm of the (already reduced) gradients, as one model on one rank would have it: replicated
    gradients counted once, each expert shard once (summed over its EP group)."""
    dense = torch.zeros((), dtype=torch.float64)
    experts = torch.zeros((), dtype=torch.float64)
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum().cpu()
        if ".experts." in n:
            experts += sq
        else:
            dense += sq
    if layout.distributed and layout.ep_size > 1:
        experts = experts.to(_comm_device(model))
        dist.all_reduce(experts, group=layout.ep.group)
        experts = experts.cpu()
    return (dense + experts).sqrt()


def _comm_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
