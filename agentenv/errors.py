"""Typed errors: each carries the cause and, where there is one, what to do about it."""

from __future__ import annotations


class AgentEnvError(Exception):
    """Base class of every error agentenv raises on purpose."""

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        self.fix = fix
        super().__init__(f"{message} — {fix}" if fix else message)


class ImageNotFound(AgentEnvError, LookupError):
    """The image does not exist in the local Docker engine."""

    def __init__(self, image: str, available: list[str]) -> None:
        self.image, self.available = image, available
        names = ", ".join(available) if available else "none"
        super().__init__(f"image {image!r} not found; images present: {names}",
                         fix="build it first, or pick one of the images present")


class SandboxNotFound(AgentEnvError, LookupError):
    """No sandbox with that id."""


class SnapshotNotFound(AgentEnvError, LookupError):
    """No snapshot with that id."""


class SandboxStateError(AgentEnvError):
    """The operation does not fit the sandbox's state (e.g. exec on a paused or closed sandbox)."""


class SandboxError(AgentEnvError):
    """The sandbox runtime (runc, overlayfs, the in-sandbox agent) failed."""


class CheckpointError(AgentEnvError):
    """A memory snapshot or restore failed in CRIU; the message names the cause and the fix."""


class StoreFullError(AgentEnvError, OSError):
    """The snapshot store ran out of space; nothing partial was kept."""


class ConnectionLost(AgentEnvError, ConnectionError):
    """The in-sandbox agent or the remote server stopped answering."""


class QuotaExceeded(AgentEnvError):
    """A server's quota (live sandboxes or memory) is used up; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, *, retry_after: float = 5.0, fix: str | None = None) -> None:
        self.retry_after = retry_after
        super().__init__(message, fix=fix or f"close or pause sandboxes, or retry in {retry_after:g} s")


class Unauthorized(AgentEnvError, PermissionError):
    """The server refused the bearer token (missing or wrong)."""
