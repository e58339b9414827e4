"""Every other port of a sandbox: an HTTP request for it is proxied to what listens there, through the sandbox's
agent (``Sandbox.open_port``: the connection is made inside the sandbox, so one without a network serves too).

The request goes on as it came (method, path, headers, streamed body) less the hop-by-hop headers and E2B's
routing ones (the sandbox's token never reaches its programs), and the response streams back as the listener
sends it (chunked stays chunked: a slow writer's bytes arrive as written). A WebSocket upgrade is spliced as raw
bytes in ``agentenv.server.e2b.upgrade``. Nothing listening is E2B's 502 ``port is not open``.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import h11
from starlette.types import Receive, Scope, Send

from agentenv import errors
from agentenv.sandbox.core import Sandbox
from agentenv.server.e2b import bridge

# the headers that say which sandbox, port and token a request is for: each may come once (the checks here read
# one value, the services behind another, so a second copy could name a sandbox whose token was never checked)
ROUTING = (b"e2b-sandbox-id", b"e2b-sandbox-port", b"x-access-token", b"e2b-traffic-access-token")
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade", b"proxy-connection"})
OPEN_TIMEOUT = 10.0   # seconds for the sandbox's agent to connect to the port
IDLE_TIMEOUT = 300.0  # seconds the listener (or the client, sending a body) may stay silent mid-request
CHUNK = 1 << 16


async def reply(send: Send, status: int, message: str, **extra: Any) -> None:
    """E2B's error body: ``{"code", "message"}`` and whatever else E2B adds (``sandboxId``, ``port``)."""
    body = json.dumps({"code": status, "message": message, **extra}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def host_route(host: bytes, domain: str | None) -> tuple[str, str] | None:
    """The (sandbox id, port) a ``Host`` header names as ``get_host`` builds it, ``{port}-{id}.{domain}``; None
    for any other host (or no domain set)."""
    if not domain:
        return None
    name = host.decode("latin-1").lower()
    if not name.startswith("["):
        name = name.rpartition(":")[0] or name if name.count(":") == 1 else name
    suffix = "." + domain.lower()
    if not name.endswith(suffix):
        return None
    port, _, sid = name[:-len(suffix)].partition("-")
    return (sid, port) if sid and port.isdigit() and "." not in sid else None


def forwarded(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The request headers the listener gets: not the hop-by-hop ones, not E2B's routing ones."""
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP and k.lower() not in ROUTING]


def closed(sandbox_id: str, port: int) -> dict[str, Any]:
    """E2B's body for a port nothing listens on (its client proxy's words)."""
    return {"message": "The sandbox is running but port is not open", "sandboxId": sandbox_id, "port": port}


async def open_port(sb: Sandbox, port: int, send: Send) -> socket.socket | None:
    """A connection to ``port`` in ``sb``, or None once the 502 that says why is sent."""
    try:
        return await bridge.run(sb.open_port, port, OPEN_TIMEOUT)
    except (errors.ConnectionLost, errors.SandboxStateError, errors.SandboxNotFound) as e:
        await reply(send, 502, f"The sandbox {sb.id} cannot be reached: {e}", sandboxId=sb.id, port=port)
    except OSError:
        await reply(send, 502, **closed(sb.id, port))
    return None


async def proxy(sb: Sandbox, port: int, scope: Scope, receive: Receive, send: Send) -> None:
    """Send the request to ``port`` of ``sb`` and stream its response back (a 502 when nothing listens)."""
    sock = await open_port(sb, port, send)
    if sock is None:
        return
    reader, writer = await asyncio.open_connection(sock=sock)
    started = False
    try:
        conn = h11.Connection(h11.CLIENT)
        headers = forwarded(scope["headers"])
        first = await receive()
        body, more = first.get("body", b""), first.get("more_body", False)
        if not any(k.lower() == b"content-length" for k, _ in headers) and (body or more):
            headers.append((b"transfer-encoding", b"chunked"))
        if not any(k.lower() == b"host" for k, _ in headers):
            headers.append((b"host", f"127.0.0.1:{port}".encode()))
        headers.append((b"connection", b"close"))
        target = scope["raw_path"] + (b"?" + scope["query_string"] if scope["query_string"] else b"")
        writer.write(conn.send(h11.Request(method=scope["method"], target=target, headers=headers)))
        while True:
            if body:
                writer.write(conn.send(h11.Data(data=body)) or b"")
                await asyncio.wait_for(writer.drain(), IDLE_TIMEOUT)
            if not more:
                break
            message = await asyncio.wait_for(receive(), IDLE_TIMEOUT)
            if message["type"] == "http.disconnect":
                return
            body, more = message.get("body", b""), message.get("more_body", False)
        writer.write(conn.send(h11.EndOfMessage()) or b"")
        await asyncio.wait_for(writer.drain(), IDLE_TIMEOUT)
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await asyncio.wait_for(reader.read(CHUNK), IDLE_TIMEOUT))
            elif isinstance(event, h11.Response):
                started = True
                await send({"type": "http.response.start", "status": event.status_code,
                            "headers": [(k, v) for k, v in event.headers if k.lower() not in HOP_BY_HOP]})
            elif isinstance(event, h11.Data):
                await send({"type": "http.response.body", "body": bytes(event.data), "more_body": True})
            elif isinstance(event, h11.EndOfMessage):
                await send({"type": "http.response.body", "body": b""})
                return
    except (h11.ProtocolError, TimeoutError, ConnectionError) as e:
        if started:
            raise  # mid-response: the client's connection is cut, so it sees a truncated answer
        await reply(send, 502, f"port {port} of sandbox {sb.id} did not answer HTTP ({type(e).__name__}: {e})",
                    sandboxId=sb.id, port=port)
    finally:
        writer.close()
