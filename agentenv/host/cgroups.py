"""The sandboxes' cgroups: made as runc makes them, for restores that run CRIU without runc (``agentenv.snapshot.criu``),
removed where runc cannot, and moved into fast (``favor_dynmods``).

``runc restore`` creates the container's cgroups and writes its limits before CRIU puts the restored processes
in them. A restore that runs CRIU directly must do the same, or the processes would come back in cgroups that
CRIU made from the dump (the source sandbox's limits, not the ones asked for now). Only cgroup v1 hosts (the
one this project runs on): on a v2 host the device rules are an eBPF program that runc attaches, so restores
there stay with runc (``v1_paths`` returns None).

The limits are those runc 1.1 writes for our ``config.json`` (``runtime.oci_config``): the device rules (deny
all, then runc's default allow list, read from runc's own record of a container), memory, CPU quota and pids.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

CGROUP_ROOT = Path("/sys/fs/cgroup")
FAVOR_ENV = "AGENTENV_FAVOR_DYNMODS"  # "0": leave the host's cgroup mount options alone
KILL_WAIT = 10.0  # seconds ``remove`` waits for the processes it ended to be gone
_DEVICE_TYPES = {97: "a", 98: "b", 99: "c"}  # runc's configs.DeviceType, as runes


def v1_paths(template: dict[str, str], old: str, new: str) -> dict[str, Path] | None:
    """Where the cgroup ``new`` lives in each hierarchy, from runc's ``cgroup_paths`` of a container whose cgroup
    was ``old``; None unless every hierarchy is a v1 one mounted under /sys/fs/cgroup (or the hybrid
    unified one beside them)."""
    if not template or (CGROUP_ROOT / "cgroup.controllers").exists():  # a pure v2 host
        return None
    paths: dict[str, Path] = {}
    for key, path in template.items():
        if not path.endswith(old):
            return None
        mount = Path(path[: len(path) - len(old)])
        if mount.parent != CGROUP_ROOT or not os.path.ismount(mount):
            return None
        paths[key] = mount / new.lstrip("/")
    return paths


def device_rule(d: dict[str, Any]) -> str:
    """One of runc's device rules (``configs.Device``) as the v1 devices controller takes it: ``c 1:3 rwm``."""
    def num(n: int) -> str:
        return "*" if n < 0 else str(n)
    return f"{_DEVICE_TYPES[int(d['type'])]} {num(int(d['major']))}:{num(int(d['minor']))} {d['permissions']}"


def create(paths: dict[str, Path], devices: list[dict[str, Any]], resources: dict[str, Any]) -> None:
    """Make the cgroups and write their limits, as runc's ``Apply`` and ``Set`` do (OSError if the kernel refuses
    one). ``devices``: runc's rules for the container; ``resources``: the OCI ``linux.resources``."""
    for key, path in paths.items():
        if key == "cpuset":
            _make_cpuset(path)
        else:
            path.mkdir(parents=True, exist_ok=True)
    dev = paths.get("devices")
    if dev is not None:
        for rule in devices:  # the first is "a *:* rwm" denied: deny all, then allow each
            (dev / ("devices.allow" if rule.get("allow") else "devices.deny")).write_text(device_rule(rule))
    limits = [("memory", "memory.limit_in_bytes", (resources.get("memory") or {}).get("limit")),
              ("cpu", "cpu.cfs_period_us", (resources.get("cpu") or {}).get("period")),
              ("cpu", "cpu.cfs_quota_us", (resources.get("cpu") or {}).get("quota")),
              ("pids", "pids.max", (resources.get("pids") or {}).get("limit"))]
    for key, name, value in limits:
        if value is not None and key in paths:
            (paths[key] / name).write_text(str(value))


def _make_cpuset(path: Path) -> None:
    """A v1 cpuset cgroup starts with no CPUs and no memory nodes (no task may join it): each level takes its
    parent's where it has none, as runc does."""
    mount = CGROUP_ROOT / "cpuset"
    d = mount
    for part in path.relative_to(mount).parts:
        d = d / part
        d.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):
            if not (d / name).read_text().strip():
                (d / name).write_text((d.parent / name).read_text())


def existing(cgroup: str) -> list[Path]:
    """The folders of the cgroup ``cgroup`` (as runc's cgroupsPath names it) in every hierarchy that has one."""
    with contextlib.suppress(OSError):
        return [d / cgroup.lstrip("/") for d in CGROUP_ROOT.iterdir() if (d / cgroup.lstrip("/")).is_dir()]
    return []


def remove(paths: Iterable[Path]) -> None:
    """End every process in these cgroups, then remove them (best effort): what a direct restore leaves where it
    failed, or where its maker died before writing runc's record (``runc delete`` knows nothing of it then)."""
    paths = list(paths)
    deadline = time.monotonic() + KILL_WAIT
    for path in paths:
        while time.monotonic() < deadline:
            try:
                pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
            except OSError:
                break
            if not pids:
                break
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            time.sleep(0.005)
    for path in paths:
        with contextlib.suppress(OSError):
            path.rmdir()


@functools.cache
def favor_dynmods() -> bool:
    """Mount the host's cgroup v2 hierarchy with ``favordynmods`` (once a process; best effort): True if it is.

    Every sandbox start moves a process into new cgroups (runc's init, or CRIU's restored tree), and on this
    kernel the first move of a batch waits for an RCU grace period: 7-15 ms of every start, 14 of a ~50 ms CRIU
    restore (measured, 2 cores, kernel 6.18). With ``favordynmods`` (Documentation/admin-guide/cgroup-v2.rst:
    cheaper migrations, slightly dearer forks and exits, host-wide; the kernel cannot turn it off again before a
    reboot) a move takes 0.2 ms. ``$AGENTENV_FAVOR_DYNMODS=0`` leaves the host as it is.
    """
    if os.environ.get(FAVOR_ENV, "1") == "0":
        return False
    for line in _mounts():
        fields = line.split()
        if len(fields) > 3 and fields[2] == "cgroup2":
            if "favordynmods" in fields[3].split(","):
                return True
            r = subprocess.run(["mount", "-o", "remount,favordynmods", fields[1]], capture_output=True, check=False)
            return r.returncode == 0
    return False


def _mounts() -> list[str]:
    try:
        return Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []


VFORK_WAITS = ("kernel_clone", "wait_for_vfork_done")  # where a vfork parent sleeps (/proc/TID/wchan; inlined or not)


def vfork_waiters(tasks: Path) -> list[int]:
    """The threads listed in a cgroup's ``tasks`` file that wait for a vfork child to exec or exit."""
    try:
        tids = [int(t) for t in tasks.read_text().split()]
    except (OSError, ValueError):
        return []
    waiting = []
    for tid in tids:
        try:
            if Path(f"/proc/{tid}/wchan").read_text().strip() in VFORK_WAITS:
                waiting.append(tid)
        except OSError:
            continue  # gone meanwhile
    return waiting
