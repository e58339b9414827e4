"""Typed errors: each carries the cause and, where there is one, what to do about it."""

from __future__ import annotations

import errno as _errno
from typing import Any


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


class ImageUnavailable(AgentEnvError, LookupError):
    """An image is not on the host and none of its sources gave it: no tarball, no mirror had it, no registry
    answered before the deadline; the message names the image and each source's reason."""


class SandboxNotFound(AgentEnvError, LookupError):
    """No sandbox with that id."""


class SnapshotNotFound(AgentEnvError, LookupError):
    """No snapshot with that id."""


class SandboxStateError(AgentEnvError):
    """The operation does not fit the sandbox's state (e.g. exec on a paused or closed sandbox)."""


class SandboxError(AgentEnvError):
    """The sandbox runtime (runc, overlayfs, the in-sandbox keeper) failed."""


class CheckpointError(AgentEnvError):
    """A memory snapshot or restore failed in CRIU; the message names the cause and the fix."""


class PageServerKeyError(CheckpointError, ValueError):
    """A post-copy migration's snapshot restored without the key its migrate call returned, or a key given for a
    snapshot that is not one (HTTP 400: the request, not the restore, is wrong); nothing was started."""


class TransferError(AgentEnvError):
    """A snapshot sent between servers arrived damaged (a chunk whose sha256 differs); nothing was kept."""


class UntrustedSnapshot(TransferError):
    """A snapshot archive refused for what it is, not for a damaged chunk: not sealed with the key this server shares
    with its sender (``agentenv.snapshot.trust``), or holding what no agentenv server packs (a device node, an owner
    outside the sandbox's ids, a record asking for what a create is refused); nothing was kept."""


class StoreFullError(AgentEnvError, OSError):
    """The snapshot store ran out of space (or reached its configured limit); nothing partial was kept."""


class DiskLimitUnsupported(AgentEnvError):
    """A disk limit (``disk=``) was asked for where this host cannot enforce one; the message says why."""


class MemorySharingUnsupported(AgentEnvError):
    """``share_memory=True`` was asked for where this host cannot merge pages (no KSM, no PR_SET_MEMORY_MERGE, or
    not allowed to switch KSM on), or while another agentenv home's sandboxes share the host's memory
    (``agentenv.host.ksm``); the message says which. The default (None) falls back to no sharing instead."""


class DiskLimitRequired(AgentEnvError, PermissionError):
    """A server refused a sandbox without a disk limit (``disk=None``): it was not started with
    ``--unlimited-disk``."""


class NetworkRuleError(AgentEnvError, ValueError):
    """A sandbox's network rule cannot be enforced as asked (an IPv6 entry, a wildcard name, a name that does not
    resolve, an address no sandbox may reach); the message names the entry. Nothing of the rules was applied."""


class NetworkUnavailable(AgentEnvError):
    """This host cannot give a sandbox the network asked for (the bridge, nftables or a veth could not be made);
    the message says which step failed."""


class ConnectionLost(AgentEnvError, ConnectionError):
    """The in-sandbox keeper or the remote server stopped answering."""


class QuotaExceeded(AgentEnvError):
    """A server's quota (live sandboxes or memory) is used up; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, *, retry_after: float = 5.0, fix: str | None = None) -> None:
        self.retry_after = retry_after
        super().__init__(message, fix=fix or f"close or pause sandboxes, or retry in {retry_after:g} s")


class Unauthorized(AgentEnvError, PermissionError):
    """The server refused the bearer token (missing or wrong)."""


class UnknownUser(AgentEnvError, LookupError):
    """The sandbox's image has no account of the name a command or file call asked to run as."""


class SandboxLost(SandboxStateError):
    """The sandbox's keeper (its PID 1) is gone: its processes died behind our back (state 'lost').

    Nothing reaches it any more, and nothing else is reached in its place; close it.
    """


# --- on the wire ---------------------------------------------------------------------------------
# One table for every hop: the server answers an exception with its HTTP status and ``to_wire`` body;
# the client and the host end of the keeper channel rebuild the same class with ``from_wire``.

_STATUS: list[tuple[type[BaseException], int]] = [
    (Unauthorized, 401), (DiskLimitRequired, 403), (NetworkRuleError, 400), (PageServerKeyError, 400),
    (SandboxNotFound, 404), (SnapshotNotFound, 404), (ImageNotFound, 404), (ImageUnavailable, 404),
    (SandboxStateError, 409),
    (QuotaExceeded, 429),
    (StoreFullError, 507),
    (DiskLimitUnsupported, 501), (NetworkUnavailable, 501), (MemorySharingUnsupported, 501),
    (UntrustedSnapshot, 403), (ConnectionLost, 502), (TransferError, 502),
    (AgentEnvError, 500),
    (FileNotFoundError, 404), (ProcessLookupError, 404), (PermissionError, 403),
    (IsADirectoryError, 409), (NotADirectoryError, 409), (FileExistsError, 409), (BrokenPipeError, 409),
    (ValueError, 400), (TypeError, 400),
]
_BUILTINS: dict[str, type[Exception]] = {c.__name__: c for c in (
    FileNotFoundError, ProcessLookupError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError,
    BrokenPipeError, TimeoutError, ValueError, TypeError, OSError)}
# a plain OSError with one of these is a file op the sandbox refused for what it was asked (a name too long, a
# folder moved into itself, one not empty...): bad input, like the OSError subclasses above
_REFUSED_ERRNOS = frozenset({_errno.ENAMETOOLONG, _errno.EINVAL, _errno.ELOOP, _errno.ENOTEMPTY, _errno.EBUSY,
                             _errno.EROFS, _errno.EXDEV, _errno.ETXTBSY, _errno.EMLINK})
_AS_VALUE_ERROR = frozenset({"ValidationError", "WireError", "BadRequest"})  # bad input, said by any hop
_BY_STATUS: dict[int, type[Exception]] = {401: Unauthorized, 404: LookupError, 409: SandboxStateError,
                                          429: QuotaExceeded, 501: DiskLimitUnsupported, 507: StoreFullError}


def status_of(exc: BaseException) -> int | None:
    """The HTTP status an exception maps to, or None when it is a bug (then 500)."""
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return code
    if type(exc) is OSError and exc.errno in _REFUSED_ERRNOS:
        return 400
    if type(exc) is OSError and exc.errno in (_errno.ENOSPC, _errno.EDQUOT):
        return 507  # the sandbox's disk (or its limit) is full: Insufficient Storage
    return None


def to_wire(exc: BaseException, subject: str | None = None) -> dict[str, Any]:
    """The wire form ``{error, message, fix, id[, retry_after, errno]}`` of an exception."""
    fix = getattr(exc, "fix", None)
    message = str(exc)
    if fix and message.endswith(f" — {fix}"):
        message = message[: -len(fix) - 3]
    body: dict[str, Any] = {"error": type(exc).__name__, "message": message, "fix": fix, "id": subject}
    if isinstance(exc, QuotaExceeded):
        body["retry_after"] = exc.retry_after
    if isinstance(exc, OSError) and not isinstance(exc, AgentEnvError):
        body["message"] = exc.strerror or str(exc)
        if exc.errno is not None:
            body["errno"] = exc.errno
    return body


def from_wire(body: Any, status: int | None = None, *,
              unknown: type[AgentEnvError] = AgentEnvError) -> Exception:
    """The exception a wire body stands for: the same class, message and fix as where it was raised.

    A name this side does not know falls back by HTTP ``status``, else to ``unknown``.
    """
    if not isinstance(body, dict):
        body = {"message": str(body)}
    name, message, fix = str(body.get("error")), str(body.get("message", "")), body.get("fix")
    if name in _AS_VALUE_ERROR:
        return ValueError(message)
    if name in _BUILTINS:
        cls = _BUILTINS[name]
        if issubclass(cls, OSError) and cls is not ProcessLookupError:
            errno = body.get("errno", 2 if cls is FileNotFoundError else None)
            return cls(errno, message.removeprefix(f"[Errno {errno}] "))  # OSError's str() puts it back
        return cls(message)
    agentenv_cls = _AGENTENV.get(name)
    if agentenv_cls is None:
        fallback = _BY_STATUS.get(status or 0)
        if fallback is None or not issubclass(fallback, AgentEnvError):
            where = f"server error {status}" if status else f"keeper error {name}"
            return (fallback or unknown)(f"{where}: {message}")
        agentenv_cls = fallback
    exc = agentenv_cls.__new__(agentenv_cls)
    Exception.__init__(exc, f"{message} — {fix}" if fix else message)
    exc.fix = fix
    if isinstance(exc, QuotaExceeded):
        exc.retry_after = float(body.get("retry_after") or 5.0)
    return exc


_AGENTENV: dict[str, type[AgentEnvError]] = {
    name: cls for name, cls in list(globals().items()) if isinstance(cls, type) and issubclass(cls, AgentEnvError)}
