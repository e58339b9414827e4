"""agentenv: containerised environments that snapshot, fork and resume fast (Docker images, runc, CRIU)."""

from agentenv import errors
from agentenv.sandbox import ExecResult, Process, Sandbox
from agentenv.store import Snapshot

__all__ = ["ExecResult", "Process", "Sandbox", "Snapshot", "errors"]
__version__ = "0.1.0"
