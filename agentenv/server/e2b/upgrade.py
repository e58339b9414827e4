"""WebSocket upgrade requests for a sandbox's port: the request goes to the listener as it came (less E2B's routing
headers), and from then on the bytes of the two connections are spliced, unread (frames, pings and closes alike).

ASGI has no raw connection, so this hooks in under it: ``GuardedHttpProtocol`` hands an upgrade request's
connection to ``Upgrades.take`` (``app.state.raw_upgrade``) instead of running the app; admission (route, token,
state) is the same as for plain requests (``agentenv.server.e2b.ports``). A refused upgrade gets E2B's JSON body.
"""

from __future__ import annotations

import asyncio
import collections
import json
from http import HTTPStatus

from agentenv.server.e2b import ports
from agentenv.server.service import Service
from policy.authlimit import Address, AuthFailures

MAX_SPLICES = 1024  # spliced connections at once (uvicorn's connection limit no longer counts them)
PER_SANDBOX = MAX_SPLICES // 4  # one sandbox's share: the traffic of one cannot take every other's WebSockets
MAX_PENDING = 1 << 20  # bytes the client may send before the sandbox's side is open (then its reading pauses)


class Upgrades:
    """Takes over the connections of upgrade requests (see the module docstring)."""

    def __init__(self, service: Service, token: str, domain: str | None, failures: AuthFailures) -> None:
        self.service, self.token, self.domain, self.failures = service, token, domain, failures
        self.tasks: set[asyncio.Task[None]] = set()
        self.spliced: collections.Counter[str] = collections.Counter()  # per sandbox

    def take(self, transport: asyncio.Transport, method: str, url: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        """The connection's from now on: splice it to the port its request names, or answer why not."""
        splice = Splice(transport)
        transport.set_protocol(splice)
        if len(self.tasks) >= MAX_SPLICES:
            splice.refuse(503, f"the server splices {MAX_SPLICES} WebSockets at most: close some, then retry")
            return
        peer = (transport.get_extra_info("peername"), transport.get_extra_info("sockname"))
        task = asyncio.get_running_loop().create_task(self._open(splice, method, url, headers, peer))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _open(self, splice: Splice, method: str, url: bytes, headers: list[tuple[bytes, bytes]],
                    peer: tuple[Address | None, Address | None]) -> None:
        route = ports.route_of(dict(headers), self.domain)
        if route is None:
            splice.refuse(404, "no WebSocket is served here but a sandbox's ports (E2b-Sandbox-Id or get_host's host)")
            return
        try:
            sid, port, _ = await ports.admit(self.service, headers, route, self.token, self.failures, peer)
            mask = (await ports.running(self.service, sid)).get(ports.MASK_LABEL)
        except ports.Refused as e:
            splice.refuse(e.status, e.message)
            return
        if self.spliced[sid] >= PER_SANDBOX:
            splice.refuse(429, f"sandbox {sid} has {PER_SANDBOX} WebSockets open, its share of the server's "
                               f"{MAX_SPLICES}: close some, then retry")
            return
        self.spliced[sid] += 1
        try:
            await self._splice(splice, sid, port, method, url, headers, mask)
        finally:
            self.spliced[sid] -= 1
            if not self.spliced[sid]:
                del self.spliced[sid]

    async def _splice(self, splice: Splice, sid: str, port: int, method: str, url: bytes,
                      headers: list[tuple[bytes, bytes]], mask: str | None) -> None:
        try:
            sock = await ports.open_port(self.service.sandbox(sid), port)
        except ports.Refused as e:
            splice.refuse(e.status, e.message, e.extra)
            return
        reader, writer = await asyncio.open_connection(sock=sock)
        kept = ports.masked([(k, v) for k, v in headers if k.lower() not in ports.ROUTING], mask, port)
        head = b"".join([method.encode(), b" ", url, b" HTTP/1.1\r\n",
                         *(k + b": " + v + b"\r\n" for k, v in kept), b"\r\n"])
        splice.attach(writer, head)
        try:
            while data := await reader.read(ports.CHUNK):
                if splice.transport.is_closing():
                    break
                splice.transport.write(data)
            if not splice.transport.is_closing() and splice.transport.can_write_eof():
                splice.transport.write_eof()
        except ConnectionError:
            pass
        finally:
            writer.close()
            splice.transport.close()


class Splice(asyncio.Protocol):
    """The client's side: what it sends waits (up to ``MAX_PENDING``) until the sandbox's side is open, then goes
    straight to it."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.pending: list[bytes] = []
        self.size = 0
        self.writer: asyncio.StreamWriter | None = None
        self.eof = False
        self.drains: set[asyncio.Task[None]] = set()

    async def _drained(self, writer: asyncio.StreamWriter) -> None:
        try:
            await writer.drain()
        except ConnectionError:
            self.transport.close()
        else:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.writer is not None:
            self.writer.write(data)
            if self.writer.transport.get_write_buffer_size() > MAX_PENDING:  # the sandbox reads slower: wait for it
                self.transport.pause_reading()
                self.drains.add(task := asyncio.get_running_loop().create_task(self._drained(self.writer)))
                task.add_done_callback(self.drains.discard)
            return
        self.pending.append(data)
        self.size += len(data)
        if self.size > MAX_PENDING:
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self.eof = True
        if self.writer is not None and self.writer.can_write_eof():
            self.writer.write_eof()
        return True  # keep the connection open for the answer

    def connection_lost(self, exc: Exception | None) -> None:
        if self.writer is not None:
            self.writer.close()

    def attach(self, writer: asyncio.StreamWriter, head: bytes) -> None:
        self.writer = writer
        writer.write(head + b"".join(self.pending))
        self.pending.clear()
        self.transport.resume_reading()
        if self.eof and writer.can_write_eof():
            writer.write_eof()

    def refuse(self, status: int, message: str, extra: dict[str, object] | None = None) -> None:
        """Answer E2B's error body instead, and close."""
        data = json.dumps({"code": status, "message": message, **(extra or {})}).encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, HTTPStatus(status).phrase.encode(), len(data), data))
        self.transport.close()
