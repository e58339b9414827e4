"""Memory shared across a fork's children (``Sandbox.create(share_memory=True)``, carried to its forks and
snapshots): KSM runs while a sharing sandbox runs on this host, in any process, and stops when none does.

Opt-in because KSM merges every flagged process of the host alike: a write to a merged page takes longer
(copy-on-write), which tells one flagged sandbox whether another holds the same page (docs/security.md).
Each change (a sharing sandbox started, paused or closed) counts the running sharing sandboxes from their
records under one host-wide lock and switches KSM to match (``agentenv.host.ksm``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os

from agentenv.config import paths
from agentenv.errors import SandboxError
from agentenv.host import ksm


def running_sharing() -> list[str]:
    """The ids of this host's running sandboxes that share memory, from their records."""
    ids = []
    for entry in os.scandir(paths().sandboxes):
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(entry.path, "sandbox.json")) as f:
                rec = json.load(f)
            if rec.get("state") == "running" and (rec.get("spec") or {}).get("share_memory"):
                ids.append(str(rec["id"]))
    return ids


def sync() -> bool:
    """Switch KSM on if a sharing sandbox runs, off (as it was found) if none does; True if it is on for them."""
    p = paths()
    with open(p.home / "ksm.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        on = bool(running_sharing())
        ksm.switch(on, p.home / "ksm-found.json")
        return on


def check_flag(sandbox_id: str, pid: int) -> None:
    """SandboxError unless the agent ``pid`` of a sharing sandbox has its pages mergeable (an image's python3
    without ctypes cannot set the flag): sharing is never promised and then silently missing."""
    if not ksm.merge_any(pid):
        raise SandboxError(f"the agent of sandbox {sandbox_id} could not mark its memory mergeable "
                           "(PR_SET_MEMORY_MERGE)", fix="use an image whose python3 has ctypes, or create the "
                                                        "sandbox without share_memory")
