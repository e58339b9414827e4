"""Where a benchmark ran, as its report records it (``bench.harness.Report``): the machine's facts (CPU, memory,
kernel, the versions of Docker, CRIU and runc), how fast it runs Python now and how much CPU the hypervisor stole
(a shared or throttled host shows there, so that two runs' figures can be set side by side), and the commit
measured. Each is cheap, and anything that cannot be read is None rather than an error.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any


def _cmd(*args: str, timeout: float = 10) -> str | None:
    """First line of a command's output, or None when it is missing, fails or hangs."""
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    out = r.stdout.strip()
    return out.splitlines()[0] if r.returncode == 0 and out else None


def git_commit(root: Path) -> tuple[str, bool | None]:
    """(HEAD commit of the checkout at ``root``, whether the work tree differs from it); ("unknown", None) outside a git checkout."""
    head = _cmd("git", "-C", str(root), "rev-parse", "HEAD")
    if head is None:
        return "unknown", None
    try:
        r = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True,
                           timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return head, None
    return head, bool(r.stdout.strip()) if r.returncode == 0 else None


def machine_info() -> dict[str, Any]:
    """Cheap facts about this machine; anything unavailable is None."""
    cpu_model = mem_gib = os_name = None
    with contextlib.suppress(OSError):
        cpu_model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                          if ln.startswith("model name")), None)
    with contextlib.suppress(OSError, ValueError, IndexError):
        kb = next((ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines()
                   if ln.startswith("MemTotal:")), None)
        mem_gib = round(int(kb) / 2**20, 1) if kb else None
    with contextlib.suppress(OSError):
        os_name = next((ln.split("=", 1)[1].strip().strip('"') for ln in Path("/etc/os-release").read_text()
                        .splitlines() if ln.startswith("PRETTY_NAME=")), None)
    load = None
    with contextlib.suppress(OSError):
        load = [round(x, 2) for x in os.getloadavg()]
    return {"hostname": platform.node(), "cpus": os.cpu_count(), "cpu_model": cpu_model or platform.processor() or None,
            "mem_total_gib": mem_gib, "kernel": platform.release(), "os": os_name,
            "python": platform.python_version(),
            "docker": _cmd("docker", "version", "--format", "{{.Server.Version}}"),
            "criu": _cmd("criu", "--version"), "runc": _cmd("runc", "--version"), "loadavg_start": load}


def cpu_probe(rounds: int = 5) -> float:
    """How fast this machine runs Python now: the median ms of a fixed loop (a shared or throttled host shows
    here, so that two runs' figures can be set side by side)."""
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        sum(i * i for i in range(200_000))
        times.append((time.perf_counter() - t) * 1000)
    return round(sorted(times)[rounds // 2], 2)


def cpu_ticks() -> tuple[int, int] | None:
    """(all, steal) CPU ticks since boot from /proc/stat; None where it cannot be read."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields[:8]), fields[7]
    return None
