"""What the in-sandbox services share: the sandbox a request is for and the account it runs as, errors as
Connect codes, and a blocking iterator turned into an async one (``agentenv.server.streaming``, shared with
the native routes).
"""

from __future__ import annotations

import base64
import binascii
import functools
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any, TypeVar

import anyio.to_thread
from anyio import CapacityLimiter
from connectrpc.code import Code
from connectrpc.codec import Codec
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof

from agentenv import errors
from agentenv.sandbox.calls import Calls
from agentenv.sandbox.core import Sandbox
from agentenv.server import streaming
from agentenv.server.e2b.template_store import USER_LABEL
from agentenv.server.service import Service

T = TypeVar("T")
DEFAULT_USER = "user"  # E2B's account: what a call that names none runs as, where the image has it
THREADS = 16  # blocking calls the requests of one sandbox may have running at once
threads: ContextVar[CapacityLimiter | None] = ContextVar("agentenv_e2b_threads", default=None)  # set per request

_CODES: list[tuple[type[BaseException], Code]] = [
    (FileNotFoundError, Code.NOT_FOUND), (ProcessLookupError, Code.NOT_FOUND), (FileExistsError, Code.ALREADY_EXISTS),
    (PermissionError, Code.PERMISSION_DENIED), (NotADirectoryError, Code.INVALID_ARGUMENT),
    (IsADirectoryError, Code.INVALID_ARGUMENT), (BrokenPipeError, Code.FAILED_PRECONDITION),
    (errors.SandboxNotFound, Code.UNAVAILABLE), (errors.SandboxStateError, Code.UNAVAILABLE),
    (errors.ConnectionLost, Code.UNAVAILABLE), (errors.QuotaExceeded, Code.RESOURCE_EXHAUSTED),
    (errors.UnknownUser, Code.UNAUTHENTICATED),
    (ValueError, Code.INVALID_ARGUMENT), (TimeoutError, Code.DEADLINE_EXCEEDED),
]


def one_of(field: str, value: Any) -> Any:
    """A oneof field's value (the generated stubs type each case with a Literal that a call cannot infer)."""
    return Oneof(field, value)


def connect_error(exc: BaseException) -> ConnectError:
    """The Connect error the SDK expects for an exception (the SDK branches on NOT_FOUND and ALREADY_EXISTS)."""
    if isinstance(exc, ConnectError):
        return exc
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return ConnectError(code, str(exc))
    return ConnectError(Code.INTERNAL, f"{type(exc).__name__}: {exc}")


class CheckedCodec:
    """A Connect codec whose undecodable messages are the client's error (``invalid_argument``, HTTP 400)
    rather than the server's (connectrpc answers any other exception with 500 ``unknown``)."""

    def __init__(self, codec: Codec[Any, Any]) -> None:
        self.codec = codec

    def name(self) -> str:
        return self.codec.name()

    def encode(self, message: Any) -> bytes:
        return self.codec.encode(message)

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        try:
            return self.codec.decode(data, message_class)
        except Exception as e:  # noqa: BLE001 - whatever the client sent
            raise ConnectError(Code.INVALID_ARGUMENT, f"a malformed {message_class.__name__}: {e}") from e


def sandbox_of(service: Service, ctx: RequestContext[Any, Any]) -> Sandbox:
    """The sandbox a call is for: the ``E2b-Sandbox-Id`` header (checked, with its token, by the dispatcher)."""
    sandbox_id = ctx.request_headers.get("e2b-sandbox-id", "")
    return service.sandbox(sandbox_id)


def user_named(headers: Mapping[str, str], query: Mapping[str, str] | None = None) -> str | None:
    """The account a request names: ``?username=`` (the ``/files`` routes), else envd's ``Authorization: Basic
    base64(user:)``; None when it names none."""
    if query is not None and query.get("username"):
        return query["username"]
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic" or not value:
        return None
    try:
        name = base64.b64decode(value, validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        raise ConnectError(Code.UNAUTHENTICATED, "a malformed Authorization header (Basic base64(user:))") from None
    return name or None


def acting(sb: Sandbox, user: str | None) -> Calls:
    """The calls of ``sb`` as the account ``user`` names (UnknownUser, E2B's unauthenticated "invalid username",
    if the image has none). A request that names none runs as E2B's ``user`` where the image has that account,
    and as root (the image's own user) where it has not, as a template built with ``set_user("root")`` would;
    a named account is never replaced by another. A sandbox of a template that set its user
    (``template_store.USER_LABEL``) runs as that one instead (root: as the image's own user, in its workdir)."""
    if user is None and (user := sb.labels.get(USER_LABEL)) == "root":
        return sb
    if user is not None:
        return sb.as_user(user)
    try:
        return sb.as_user(DEFAULT_USER)
    except errors.UnknownUser:
        return sb


async def run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """A blocking call off the event loop, in a thread of the request's sandbox: ``SandboxPorts`` gives each
    sandbox a limiter of its own (``threads``), so calls that block in one sandbox (a write to a stdin nobody
    reads waits 30 s) take neither the threads of another sandbox nor those of the control plane."""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=threads.get())


async def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """A blocking sandbox call off the event loop (``run``), its errors as Connect errors."""
    try:
        return await run(fn, *args, **kwargs)
    except ConnectError:
        raise
    except Exception as e:  # noqa: BLE001 - every failure reaches the client as a typed Connect error
        raise connect_error(e) from e


def iterate(make: Callable[[], Iterator[T]]) -> AsyncIterator[T]:
    """``agentenv.server.streaming.iterate`` (a blocking iterator in a thread of its own), its errors as Connect
    errors."""
    return streaming.iterate(make, connect_error)
