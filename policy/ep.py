"""Expert parallelism on torch.distributed: routed experts are sharded across ranks, and each token's latent
is sent to the rank that holds its expert and back with a differentiable ``all_to_all_single``.

Every rank runs the dense parts on its own tokens (data parallel); only the routed experts are split.
gloo serves CPU (uneven splits work), NCCL serves GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

ExpertFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class EPGroup:
    """Where this process sits in the expert-parallel group."""

    rank: int = 0
    world: int = 1
    group: Any = None  # a torch.distributed ProcessGroup, or None for the default group

    def expert_range(self, num_experts: int) -> range:
        """The global ids of the experts this rank holds (contiguous shards)."""
        if num_experts % self.world:
            raise ValueError(f"{num_experts} experts do not split evenly over {self.world} EP ranks")
        n = num_experts // self.world
        return range(self.rank * n, (self.rank + 1) * n)


def init_ep(rank: int, world: int, port: int, backend: str | None = None) -> EPGroup:
    """Join a ``world``-rank group on 127.0.0.1:``port`` (gloo on CPU, NCCL when CUDA is available)."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return EPGroup(rank, world, None)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` whose backward is the reverse all-to-all (splits swapped)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any = None) -> torch.Tensor:
    """Differentiable all-to-all of the rows of ``x``: ``in_splits[r]`` rows go to rank r."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def dispatch_combine(
    z: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, experts: ExpertFn, num_experts: int,
    ep: EPGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run each token (N, D) through its top-k experts ``idx`` (N, k) and return the ``weight``-ed sum.

    ``experts(tokens, counts)`` computes this rank's experts on tokens grouped by local expert.
    Also returns how many tokens each local expert received (from all ranks): the load metric.
    """
    N, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)                    # group (token, slot) pairs by expert
    tokens = z[order // k]
    counts = torch.bincount(flat, minlength=num_experts)
    if ep is None or ep.world == 1:
        out_sorted = experts(tokens, counts)
        local_counts = counts
    else:
        E_local = num_experts // ep.world
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=ep.group)  # [src rank][local expert]
        in_splits = counts.view(ep.world, E_local).sum(1).tolist()
        out_splits = recv_counts.view(ep.world, E_local).sum(1).tolist()
        recv = all_to_all(tokens, out_splits, in_splits, ep.group)
        local_ids = torch.repeat_interleave(torch.arange(E_local, device=z.device).repeat(ep.world), recv_counts)
        perm = torch.argsort(local_ids, stable=True)            # source-major -> expert-major
        local_counts = recv_counts.view(ep.world, E_local).sum(0)
        y = experts(recv[perm], local_counts)[torch.argsort(perm)]
        out_sorted = all_to_all(y, in_splits, out_splits, ep.group)
    out = out_sorted[torch.argsort(order)].view(N, k, out_sorted.shape[-1])
    return (out * weight.unsqueeze(-1).to(out.dtype)).sum(1), local_counts


def shard_state_dict(state: dict[str, torch.Tensor], ep: EPGroup) -> dict[str, torch.Tensor]:
    """Slice the stacked routed-expert tensors of a full checkpoint down to this rank's experts."""
    out = {}
    for name, t in state.items():
        if ".experts." in name:
            r = ep.expert_range(t.shape[0])
            t = t[r.start:r.stop]
        out[name] = t
    return out
