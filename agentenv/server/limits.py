"""What one client may cost the server: bounded request bodies, and connections that must make progress.

Bodies. ``BodyLimit`` (ASGI middleware) refuses a body whose ``Content-Length`` is over the route's
limit before reading a byte, and counts the bytes of a body that has none (chunked), failing the
request with 413 at the limit; nothing reads more than the limit into memory. Uploads
(``PUT .../files``, and E2B's ``POST /files``) may carry ``MAX_UPLOAD``, every other body ``MAX_BODY``.

Connections. ``GuardedHttpProtocol`` is uvicorn's httptools protocol with the deadlines it lacks: a
request's headers must arrive within ``HEADER_TIMEOUT`` seconds of its first byte (or of the
connection, when nothing comes), be at most ``MAX_HEADER_BYTES`` long, and a body being sent must
make progress every ``BODY_IDLE_TIMEOUT`` seconds; otherwise the connection is closed. With uvicorn's
own keep-alive timeout and connection limit (``serve``), a slowloris client holds nothing for long.
"""

from __future__ import annotations

import re
from asyncio import TimerHandle
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from agentenv import wire

MAX_UPLOAD = 1 << 30      # bytes of one file upload
MAX_BODY = 32 << 20       # bytes of any other request body (an exec's command, env and all)
HEADER_TIMEOUT = 10.0     # seconds for a request's headers to arrive
BODY_IDLE_TIMEOUT = 30.0  # seconds a body being sent may stall
MAX_HEADER_BYTES = 64 << 10
MAX_CONNECTIONS = 1024    # uvicorn answers 503 past this many connections and tasks
_UPLOAD = re.compile(r"^/v1/sandboxes/[^/]+/files$")
_TEMPLATE_UPLOAD = re.compile(r"^/e2b/template-files/[0-9a-f]+$")  # a template's copy step (e2b.templates)


class BodyTooLarge(HTTPException):
    """A request body over its route's limit (HTTP 413); an HTTPException so that FastAPI's body parsing
    passes it through instead of calling it a parse error."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(413, f"the request body is over the limit of {limit} bytes")


def body_limit(method: str, path: str, headers: dict[bytes, bytes] | None = None) -> int:
    """MAX_UPLOAD for file uploads (ours, E2B's ``POST /files`` into a sandbox and its template files), else
    MAX_BODY."""
    if method == "PUT" and (_UPLOAD.match(path) or _TEMPLATE_UPLOAD.match(path)):
        return MAX_UPLOAD
    if method == "POST" and path == "/files" and headers and b"e2b-sandbox-id" in headers:
        return MAX_UPLOAD
    return MAX_BODY


def too_large_body(limit: int, subject: str | None = None) -> dict[str, Any]:
    return {"error": "PayloadTooLarge", "message": f"the request body is over the limit of {limit} bytes",
            "fix": "send less (uploads up to 1 GiB; other bodies up to 32 MiB)", "id": subject}


class BodyLimit:
    """ASGI middleware: every request body bounded while it streams in (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        limit = body_limit(scope["method"], scope["path"], headers)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            await _reply_413(scope, send, limit)
            return
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, bounded, send)


async def _reply_413(scope: Scope, send: Send, limit: int) -> None:
    accept = dict(scope["headers"]).get(b"accept", b"").decode("latin-1")
    mp = wire.wants_msgpack(accept)
    body = wire.encode(too_large_body(limit), mp)
    await send({"type": "http.response.start", "status": 413, "headers": [
        (b"content-type", (wire.MSGPACK if mp else wire.JSON).encode()), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header and body deadlines and a header size cap."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: TimerHandle | None = None
        self._in_headers = False
        self._in_body = False
        self._header_bytes = 0

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self._in_body and self.flow is not None and self.flow.read_paused:
            self._arm(BODY_IDLE_TIMEOUT)  # we stopped reading (the app is busy): not the client's stall
            return
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._in_headers = True
        self._arm(HEADER_TIMEOUT)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_body:
            self._arm(BODY_IDLE_TIMEOUT)
        counting = self._in_headers
        super().data_received(data)
        if counting and self._in_headers:  # the headers are still incomplete after this chunk
            self._header_bytes += len(data)
            if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
                self._disarm()
                self.send_400_response("request headers too large")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_headers:
            self._in_headers, self._header_bytes = True, 0
            self._arm(HEADER_TIMEOUT)

    def on_headers_complete(self) -> None:
        self._in_headers, self._in_body = False, True
        self._arm(BODY_IDLE_TIMEOUT)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        self._disarm()
        super().on_message_complete()

    def _raw_upgrade(self) -> Any:
        """What takes the connection of an upgrade request (``app.state.raw_upgrade``: E2B's sandbox ports), if any."""
        return getattr(getattr(self.config.app, "state", None), "raw_upgrade", None)

    def _should_upgrade_to_ws(self) -> bool:
        return self.ws_protocol_class is not None or self._raw_upgrade() is not None

    def handle_websocket_upgrade(self) -> None:
        take = self._raw_upgrade()
        if take is None:
            super().handle_websocket_upgrade()
            return
        self._disarm()
        self._in_body = False
        self.connections.discard(self)
        take(self.transport, self.scope["method"], self.url, list(self.scope["headers"]))
