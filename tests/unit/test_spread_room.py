"""How many children a server has room for in a spread fork (``agentenv.remote.spread.room``): the tightest of
its free sandbox slots, memory and disk."""

from __future__ import annotations

from agentenv.api import Limits
from agentenv.remote.spread import room


def info(sandboxes: int, memory: int, disk: int) -> dict[str, dict[str, int]]:
    return {"capacity": {"free_sandboxes": sandboxes, "free_memory": memory, "free_disk": disk}}


def test_the_tightest_of_slots_memory_and_disk_bounds_the_room():
    limits = Limits(memory=256 << 20, disk=1 << 30)
    assert room(info(10, 1 << 30, 100 << 30), limits) == 4  # memory: 4 x 256 MiB
    assert room(info(3, 1 << 30, 100 << 30), limits) == 3  # slots
    assert room(info(10, 1 << 30, (2 << 30) + 5), limits) == 2  # disk
    assert room(info(10, 100 << 20, 100 << 30), limits) == 0


def test_a_sandbox_without_a_disk_limit_is_not_bounded_by_disk():
    assert room(info(5, 8 << 30, 0), Limits(memory=1 << 30, disk=None)) == 5
