"""agentenv: containerised environments that snapshot, fork and resume fast (Docker images, runc, CRIU).

The contract (value types and Protocols) is ``agentenv.api``; this module is its local implementation
(``agentenv.Sandbox``, ``agentenv.Snapshot``), ``connect`` and ``Pool`` its remote ones. Gymnasium
environments live in the ``envs`` package, so importing this one stays light.
"""

from typing import Any

from agentenv import errors
from agentenv.api import Backend, ExecResult, Limits, SandboxInfo, SandboxLike, SnapshotInfo, SnapshotLike
from agentenv.sandbox import Process, Sandbox
from agentenv.store import Snapshot

__all__ = ["Backend", "ExecResult", "Limits", "Pool", "Process", "Sandbox", "SandboxInfo", "SandboxLike",
           "Snapshot", "SnapshotInfo", "SnapshotLike", "connect", "errors"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``connect`` and ``Pool`` (the remote API) are imported on first use: httpx is not needed locally."""
    if name == "connect":
        from agentenv.client import connect

        return connect
    if name == "Pool":
        from agentenv.pool import Pool

        return Pool
    raise AttributeError(f"module 'agentenv' has no attribute {name!r}")
