"""agentenv: containerised environments that snapshot, fork and resume fast (Docker images, runc, CRIU)."""

import gymnasium

from agentenv import errors
from agentenv.sandbox import ExecResult, Process, Sandbox
from agentenv.shell_env import ShellEnv
from agentenv.store import Snapshot

__all__ = ["ExecResult", "Process", "Sandbox", "ShellEnv", "Snapshot", "errors"]
__version__ = "0.1.0"

if "agentenv/Shell-v0" not in gymnasium.registry:
    gymnasium.register(id="agentenv/Shell-v0", entry_point="agentenv.shell_env:ShellEnv")
