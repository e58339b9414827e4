"""What an agentenv home still holds after its user is done, beyond ``conftest.leaked`` (containers, mounts, records,
snapshots, veths, uid leases): the processes that run for it (the home's reaper, a server), the sandbox cgroups it
left, every mount under it; and ``agentenv`` run in it. Shared by the tests that check a home is left empty
(test_deadlines.py, test_newcomer.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from agentenv.sandbox import watchdog

ROOT = Path(__file__).resolve().parents[2]
CGROUPS = Path("/sys/fs/cgroup")


def processes(home: Path, marker: str) -> list[int]:
    """The pids of the processes whose command line holds ``marker`` and whose environment sets
    ``AGENTENV_HOME=home`` (what a home's reaper and ``agentenv serve`` run with)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd, env = (proc / "cmdline").read_bytes(), (proc / "environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmd and f"AGENTENV_HOME={home}".encode() in env.split(b"\0"):
            found.append(int(proc.name))
    return found


def reapers(home: Path) -> list[int]:
    """The pids of ``home``'s reaper processes (``agentenv.sandbox.watchdog``)."""
    return processes(home, watchdog.MODULE)


def mounts_under(home: Path) -> list[str]:
    """Every mount point at or under ``home`` in this process's mount table (/proc/self/mountinfo), the volume's
    and the uid ranges' included."""
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return [m for m in points if m == str(home) or m.startswith(f"{home}/")]


def sandbox_cgroups() -> set[str]:
    """The sandboxes' cgroups (``/agentenv/ae-ID``, agentenv.host.runtime) on this host, of every home, cgroup v1
    or v2."""
    return {p.name for p in [*CGROUPS.glob("*/agentenv/ae-*"), *CGROUPS.glob("agentenv/ae-*")] if p.is_dir()}


def cgroups_left(home: Path, before: set[str]) -> list[str]:
    """The sandbox cgroups made since ``before`` that are still there and not another home's: empty ones, or ones
    whose processes stand on a root mounted from ``home`` (its overlay's layers). A live sandbox of another home
    (a test running beside this one) is told apart so; wait on this to let a cgroup another home is making or
    removing right now come and go."""
    left = []
    for name in sorted(sandbox_cgroups() - before):
        pids: set[str] = set()
        for procs in [*CGROUPS.glob(f"*/agentenv/{name}/cgroup.procs"), *CGROUPS.glob(f"agentenv/{name}/cgroup.procs")]:
            try:
                pids |= set(procs.read_text().split())
            except OSError:
                continue
        roots = [r for r in map(_root_mount, pids) if r is not None]
        if not roots or any(f"{home}/" in r for r in roots):
            left.append(name)
    return left


def _root_mount(pid: str) -> str | None:
    """The line of process ``pid``'s mount table that mounts its ``/`` (None once it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line for line in lines if line.split()[4] == "/"), None)


def agentenv_cli(home: Path, *args: str) -> str:
    """What ``agentenv ARGS`` printed in ``home``, its whitespace folded (it fails the test if the command fails)."""
    r = subprocess.run([sys.executable, "-m", "agentenv", *args], capture_output=True, text=True, timeout=600,
                       check=False, cwd=ROOT, env={**os.environ, "AGENTENV_HOME": str(home), "PYTHONPATH": str(ROOT),
                                                   "COLUMNS": "500"})
    assert r.returncode == 0, f"agentenv {' '.join(args)} exited {r.returncode}: {r.stderr[-3000:]}"
    return " ".join(r.stdout.split())
