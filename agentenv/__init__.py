"""agentenv: containerised environments that snapshot, fork and resume fast (Docker images, runc, CRIU)."""

from typing import Any

import gymnasium

from agentenv import errors
from agentenv.sandbox import ExecResult, Process, Sandbox
from agentenv.shell_env import ShellEnv
from agentenv.store import Snapshot

__all__ = ["ExecResult", "Pool", "Process", "Sandbox", "ShellEnv", "Snapshot", "connect", "errors"]
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

if "agentenv/Shell-v0" not in gymnasium.registry:
    gymnasium.register(id="agentenv/Shell-v0", entry_point="agentenv.shell_env:ShellEnv")
