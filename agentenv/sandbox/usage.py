"""What a running sandbox uses now: CPU time and memory from its cgroups (v1 ``memory`` / ``cpuacct`` or the
v2 files, whichever the host has), disk from its layer on the volume. E2B's ``get_metrics`` reads it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from agentenv.host import cgroups, volume
from agentenv.sandbox.parts import Parts


@dataclass(frozen=True)
class Usage:
    """One reading: ``cpu_seconds`` used since the start, memory in use (page cache apart) and the disk used."""

    at: float
    cpu_seconds: float
    mem_used: int
    mem_cache: int
    disk_used: int


def _number(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _stat(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[key] = int(value)
    return out


def read(sb: Parts) -> Usage | None:
    """The sandbox's usage now; None when it has no cgroup (it is not running)."""
    container = sb.lifecycle.container
    cpu = mem = None
    cache = 0
    for d in cgroups.existing(container.cgroup):
        if (v := _number(d / "cpuacct.usage")) is not None:  # v1: nanoseconds
            cpu = v / 1e9
        elif "usage_usec" in (stat := _stat(d / "cpu.stat")):  # v2: microseconds
            cpu = stat["usage_usec"] / 1e6
        if (v := _number(d / "memory.usage_in_bytes")) is not None:  # v1: the page cache included
            mem, cache = v, _stat(d / "memory.stat").get("total_cache", 0)
        elif (v := _number(d / "memory.current")) is not None:
            mem, cache = v, _stat(d / "memory.stat").get("file", 0)
    if cpu is None or mem is None:
        return None
    disk = volume.referenced(container.layer)
    return Usage(time.time(), cpu, max(0, mem - cache), cache,
                 disk if disk is not None else volume.disk_usage(container.upper))


def sample(sandboxes: Iterable[Parts], window: float = 0.2) -> dict[str, tuple[Usage, float]]:
    """Each running sandbox's usage and the share of its CPUs it used (percent) over ``window`` seconds, read
    for all of them across one wait; a sandbox without a cgroup is left out."""
    first = {sb.id: (sb, u) for sb in sandboxes if (u := read(sb)) is not None}
    if first:
        time.sleep(window)
    out = {}
    for sid, (sb, before) in first.items():
        after = read(sb)
        if after is None:
            continue
        out[sid] = (after, cpu_share(before, after, sb.container_spec().limits.cpus))
    return out


def stall_hint(sb: Parts) -> str:
    """Why the sandbox's keeper may not be answering, read from its cgroups and /proc (for an error message): its
    memory against the limit (and a memory OOM it is stuck in), its processes against the pids limit, a freezer
    left on, and the states of the keeper's threads (``T``: stopped, ``t``: held by a tracer such as CRIU, ``D``:
    waiting in the kernel). Never raises: what cannot be read is left out."""
    said: list[str] = []
    with contextlib.suppress(Exception):
        for d in cgroups.existing(sb.lifecycle.container.cgroup):
            used = _number(d / "memory.usage_in_bytes") or _number(d / "memory.current")
            limit = _number(d / "memory.limit_in_bytes") or _number(d / "memory.max")
            if used is not None and limit is not None:
                said.append(f"memory {used >> 20}/{limit >> 20} MiB")
            if _stat(d / "memory.oom_control").get("under_oom") == 1:
                said.append("stuck in an out-of-memory wait")
            if (pids := _number(d / "pids.current")) is not None:
                said.append(f"{pids} pids of {_text(d / 'pids.max') or '?'}")
            if _text(d / "freezer.state") not in ("", "THAWED") or _text(d / "cgroup.freeze") == "1":
                said.append("frozen")
        keeper = sb.record.init_pid
        for pid in [keeper] if isinstance(keeper, int) else sb.lifecycle.container.pids()[:1]:  # else the first started
            states: dict[str, int] = {}
            with contextlib.suppress(OSError):
                for task in list(Path(f"/proc/{pid}/task").iterdir())[:256]:
                    with contextlib.suppress(OSError, IndexError):
                        state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                        key = f"{state} {_text(task / 'wchan')}" if state in ("D", "T") else state
                        states[key] = states.get(key, 0) + 1
            said.append("keeper threads: " + (", ".join(f"{n} {k}" for k, n in sorted(states.items())) or "none"))
    return "; ".join(said) or "no cgroup (not running)"


def cpu_share(before: Usage, after: Usage, cpus: float) -> float:
    """The share of its ``cpus`` (percent) a sandbox used between two readings (the console's live view keeps
    the last one instead of waiting)."""
    spent = max(0.0, after.cpu_seconds - before.cpu_seconds) / max(after.at - before.at, 1e-6)
    return min(100.0, 100.0 * spent / max(cpus, 0.01))
