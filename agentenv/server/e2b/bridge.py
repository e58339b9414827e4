"""What the in-sandbox services share: the sandbox a request is for, errors as Connect codes, and a blocking
iterator turned into an async one (``agentenv.server.streaming``, shared with the native routes).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Iterator
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
from agentenv.sandbox.core import Sandbox
from agentenv.server import streaming
from agentenv.server.service import Service

T = TypeVar("T")
THREADS = 16  # blocking calls the requests of one sandbox may have running at once
threads: ContextVar[CapacityLimiter | None] = ContextVar("agentenv_e2b_threads", default=None)  # set per request

_CODES: list[tuple[type[BaseException], Code]] = [
    (FileNotFoundError, Code.NOT_FOUND), (ProcessLookupError, Code.NOT_FOUND), (FileExistsError, Code.ALREADY_EXISTS),
    (PermissionError, Code.PERMISSION_DENIED), (NotADirectoryError, Code.INVALID_ARGUMENT),
    (IsADirectoryError, Code.INVALID_ARGUMENT), (BrokenPipeError, Code.FAILED_PRECONDITION),
    (errors.SandboxNotFound, Code.UNAVAILABLE), (errors.SandboxStateError, Code.UNAVAILABLE),
    (errors.ConnectionLost, Code.UNAVAILABLE), (errors.QuotaExceeded, Code.RESOURCE_EXHAUSTED),
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
