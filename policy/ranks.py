"""The rank loop, written once: rank 0 sends a typed op to every rank, each rank handles it, rank 0 gathers replies.

Both multi-process parts of the project run it: the policy's EP ranks (``policy.runner``: a step's plan, a weight
load) and the trainer's ranks (``trainer.distributed.rank``: a step, scoring, saves and loads). Rank 0 lives in the
caller's process and holds a ``Ranks``; ranks 1..world-1 are processes (spawned by ``spawn_ranks``, or Ray actors)
that run ``serve`` until rank 0 sends ``Stop``. An op is a frozen dataclass deriving from ``Op``; its class says
whether ranks reply (``replied``), so a handler is a function of a tagged union, not a string in a dict. The device
and thread helpers every rank starts with are here too. It lives in ``policy`` because ``policy`` imports no other
package of the project (docs/architecture.md §1), so the trainer can use it and the policy need not know the trainer.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, ClassVar, Generic, TypeVar, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

R = TypeVar("R")


@dataclass(frozen=True)
class Op(Generic[R]):
    """A message rank 0 broadcasts to every rank, whose handling gives an ``R``. ``replied``: every rank sends its
    result back (gathered); an op that is not is only sent."""

    replied: ClassVar[bool] = True


@dataclass(frozen=True)
class Stop(Op[None]):
    """The last op: the ranks leave their loop and the process group."""

    replied: ClassVar[bool] = False


@dataclass(frozen=True)
class Reply(Generic[R]):
    """A rank's answer when failures are reported: its result, or the traceback of what it raised."""

    value: R | None = None
    error: str | None = None


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on ``host``, where rank 0's process group will listen."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_device(device: str, index: int) -> str:
    """One GPU per rank on CUDA (NCCL: ``index`` is the rank's GPU on its machine); every rank on the CPU otherwise
    (gloo)."""
    if device.startswith("cuda"):
        torch.cuda.set_device(index)
        return f"cuda:{index}"
    return "cpu"


def threads_per_rank(world: int) -> int:
    """Split the machine's cores evenly over the ranks (they all compute at once)."""
    return max(1, (os.cpu_count() or 1) // world)


def spawn_ranks(world: int, target: Callable[..., None], *args: Any) -> list[BaseProcess]:
    """Start ranks 1..world-1 as spawned daemon processes running ``target(rank, *args)``."""
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = []
    for r in range(1, world):
        p = ctx.Process(target=target, args=(r, *args), daemon=True)
        p.start()
        procs.append(p)
    return procs


def _attempt(rank: int, handle: Callable[[Any], R], op: Op[Any]) -> Reply[R]:
    try:
        return Reply(handle(op))
    except Exception:  # reported to rank 0, which raises it
        return Reply(error=f"rank {rank}: {traceback.format_exc()}")


def serve(rank: int, handle: Callable[[Any], object], *, report: bool = False, until_gone: bool = False) -> None:
    """Rank ``rank``'s loop (one of 1..world-1): handle each op rank 0 broadcasts, reply to those that ask, until
    ``Stop``; then leave the process group. ``report``: a failure goes back to rank 0 as a ``Reply`` (which raises
    it there) instead of ending this rank. ``until_gone``: a rank 0 that vanished without ``Stop`` ends the loop
    quietly, leaving the group as it is."""
    while True:
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0)
        except RuntimeError:   # rank 0 is gone (its process ended without Stop): nothing left to serve
            if until_gone:
                return
            raise
        op = box[0]
        if isinstance(op, Stop):
            break
        result = _attempt(rank, handle, op) if report else handle(op)
        if op.replied:
            dist.gather_object(result, None, dst=0)
    dist.destroy_process_group()


class Ranks:
    """Rank 0's end of the loop: ``handle`` is rank 0's own handler; with ``error``, ranks report failures and
    ``call`` raises them as ``error`` (every rank's traceback), else a failing rank fails on its own."""

    def __init__(self, world: int, handle: Callable[[Any], object], error: type[Exception] | None = None) -> None:
        self.world, self.handle, self.error = world, handle, error

    def send(self, op: Op[Any]) -> None:
        """Broadcast ``op`` (nothing to send with one rank)."""
        if self.world > 1:
            dist.broadcast_object_list([op], src=0)

    def call(self, op: Op[R]) -> list[R]:
        """Run the replied ``op`` on every rank, rank 0 here; returns every rank's result, in rank order."""
        assert op.replied, f"{type(op).__name__} is only sent"
        if self.world == 1:
            return [cast(R, self.handle(op))]
        self.send(op)
        mine: object = self.handle(op) if self.error is None else _attempt(0, self.handle, op)
        gathered: list[Any] = [None] * self.world
        dist.gather_object(mine, gathered, dst=0)
        if self.error is None:
            return gathered
        errors = [g.error for g in gathered if g.error is not None]
        if errors:
            raise self.error("\n".join(errors))
        return [g.value for g in gathered]

    def stop(self) -> None:
        """Send ``Stop``: the other ranks leave their loops."""
        self.send(Stop())
