"""Every other port of a sandbox: an HTTP request for it is proxied to what listens there, through the sandbox's
keeper (``Sandbox.open_port``: the connection is made inside the sandbox, so one without a network serves too).

The request goes on as it came (method, path, headers, streamed body) less the hop-by-hop headers and E2B's
routing ones (the sandbox's token never reaches its programs), and the response streams back as the listener
sends it (chunked stays chunked: a slow writer's bytes arrive as written). A WebSocket upgrade is spliced as raw
bytes in ``agentenv.server.e2b.upgrade``. Nothing listening is E2B's 502 ``port is not open``.

Three of the sandbox's labels, set at create, govern its traffic: ``allowPublicTraffic`` (its ports need no
token; envd's and the interpreter's still do), ``maskRequestHost`` (the Host its listeners get) and
``lifecycle.autoResume`` (a request for it while it is paused resumes it first, once for every request that
waits: ``wake``).
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
from agentenv.server.e2b import bridge, tokens
from agentenv.server.e2b.tokens import ENVD_PORT, INTERPRETER_PORT
from agentenv.server.service import Service
from agentenv.snapshot.store import Snapshot
from policy.authlimit import Address, AuthFailures, Peer, Spent

# the headers that say which sandbox, port and token a request is for: each may come once (the checks here read
# one value, the services behind another, so a second copy could name a sandbox whose token was never checked)
ROUTING = (b"e2b-sandbox-id", b"e2b-sandbox-port", b"x-access-token", b"e2b-traffic-access-token")
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade", b"proxy-connection"})
OPEN_TIMEOUT = 10.0   # seconds for the sandbox's keeper to connect to the port
IDLE_TIMEOUT = 300.0  # seconds the listener (or the client, sending a body) may stay silent mid-request
CHUNK = 1 << 16
PUBLIC_LABEL = "e2b.allow_public_traffic"  # "true": network.allowPublicTraffic, its ports open without the token
MASK_LABEL = "e2b.mask_request_host"  # network.maskRequestHost: the Host its ports' requests carry
AUTO_RESUME_LABEL = "e2b.auto_resume"  # "true": lifecycle.auto_resume, a request for it resumes it when paused
TIMEOUT_LABEL = "e2b.timeout"  # the timeout (s) it was made with: an auto-resume gives it again (5 min at least)
AUTO_RESUME_MIN_TTL = 300.0  # E2B: an auto-resumed sandbox gets its first timeout, but never under five minutes
CREDENTIAL = "agentenv.e2b_credential"  # in the scope of an admitted request: the token that admitted it ("envd",
# "traffic"), "signed" (a signed /files URL) or "public" (none: a port of a sandbox made with allowPublicTraffic)


async def reply(send: Send, status: int, message: str, headers: dict[str, str] | None = None, **extra: Any) -> None:
    """E2B's error body: ``{"code", "message"}`` and whatever else E2B adds (``sandboxId``, ``port``)."""
    body = json.dumps({"code": status, "message": message, **extra}).encode()
    more = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *more]})
    await send({"type": "http.response.body", "body": body})


def host_route(host: bytes, domain: str | None) -> tuple[str, str] | None:
    """The (sandbox id, port) a ``Host`` header names as ``get_host`` builds it, ``{port}-{id}.{domain}`` (the
    domain may carry the server's port, which ``get_host`` then names too); None for any other host."""
    if not domain:
        return None
    name = host.decode("latin-1").lower()
    suffix = "." + domain.lower()
    if not name.endswith(suffix) and name.count(":") == 1:  # a domain with no port: the Host's own port goes
        name = name.partition(":")[0]
    if not name.endswith(suffix):
        return None
    port, _, sid = name[:-len(suffix)].partition("-")
    return (sid, port) if sid and port.isdigit() and "." not in sid else None


def route_of(headers: dict[bytes, bytes], domain: str | None) -> tuple[str, str] | None:
    """The (sandbox id, port) a request is for: its ``E2b-Sandbox-Id`` / ``E2b-Sandbox-Port`` headers (envd's port
    by default), else its ``Host`` as ``get_host`` builds it; None for a request of the server's own."""
    sandbox_id = headers.get(b"e2b-sandbox-id")
    if sandbox_id is not None:
        return sandbox_id.decode("latin-1"), headers.get(b"e2b-sandbox-port", str(ENVD_PORT).encode()).decode("latin-1")
    return host_route(headers.get(b"host", b""), domain)


class Refused(Exception):
    """A request for a sandbox's port that is answered ``status`` with E2B's body instead (``headers`` on top)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.headers, self.extra = status, message, headers or {}, extra


def admitted_headers(headers: list[tuple[bytes, bytes]]) -> None:
    """``Refused`` (400) where a routing header comes more than once."""
    names = [k.lower() for k, _ in headers]
    repeated = [k.decode() for k in ROUTING if names.count(k) > 1]
    if repeated:
        raise Refused(400, f"the header {repeated[0]} is given more than once")


def admitted(headers: list[tuple[bytes, bytes]], route: tuple[str, str], token: str,
             public: bool = False) -> tuple[str, int, str]:
    """The sandbox, port and credential (``CREDENTIAL``'s) of a request that ``route`` names, once one of the tokens
    that open that port checks out (``tokens.opens``; ``Refused`` if none does); ``public``: the sandbox was made
    with ``allowPublicTraffic``, so the ports its traffic token opens need none (envd's and the interpreter's
    still do)."""
    admitted_headers(headers)
    sid, port = route
    number = int(port) if port.isascii() and port.isdigit() and len(port) <= 5 else -1
    kinds = tokens.opens(number)
    kind = tokens.presented(dict(headers), token, sid, kinds)
    own = number in (ENVD_PORT, INTERPRETER_PORT)
    if kind is None and not (public and not own):
        # envd and the interpreter answer 401 themselves in E2B (the SDK's AuthenticationException); any other port
        # is refused by E2B's proxy, with a 403
        wanted = " or ".join(f"{tokens.HEADERS[k].decode()} (the {k} access token of create/connect)" for k in kinds)
        raise Refused(401 if own else 403, f"missing or wrong access token for port {port[:16]} of sandbox {sid}: "
                                            f"send {wanted}")
    if not 0 < number < 65536:
        raise Refused(502, f"The sandbox {sid} is running but port {port[:16]} is not open (not a TCP port)")
    return sid, number, kind or "public"


def budget(failures: AuthFailures, peer: tuple[Address | None, Address | None], sent: bool) -> Peer | None:
    """``failures.before`` (``policy.authlimit``), a spent budget answered as E2B's 429 with Retry-After."""
    try:
        return failures.before(*peer, sent)
    except Spent as e:
        raise Refused(429, str(e), {"Retry-After": str(e.seconds)}) from None


def _labels(service: Service, sandbox_id: str) -> dict[str, str]:
    try:
        return service.sandbox(sandbox_id).labels
    except (errors.SandboxNotFound, ValueError):
        return {}


async def admit(service: Service, headers: list[tuple[bytes, bytes]], route: tuple[str, str], token: str,
                failures: AuthFailures, peer: tuple[Address | None, Address | None]) -> tuple[str, int, str]:
    """``admitted``, where a request without the token is let through to a port of a sandbox made with
    ``allowPublicTraffic`` (its label, read only then: a request with the token costs no record read). A request
    that sent a token and is refused all the same spends its ``peer``'s budget (``policy.authlimit``); one whose
    peer's budget is spent is refused (429) before its token is checked."""
    admitted_headers(headers)
    sent = tokens.sent({k.lower(): v for k, v in headers})
    who = budget(failures, peer, sent)
    try:
        try:
            return admitted(headers, route, token)
        except Refused as e:
            if e.status != 403 or (await bridge.run(_labels, service, route[0])).get(PUBLIC_LABEL) != "true":
                raise
        return admitted(headers, route, token, public=True)
    except Refused as e:
        if sent and e.status in (401, 403):
            failures.failed(*peer, who)
        raise


def masked(headers: list[tuple[bytes, bytes]], mask: str | None, port: int) -> list[tuple[bytes, bytes]]:
    """The headers with ``Host`` as ``maskRequestHost`` says (``${PORT}`` is the port asked for), as E2B's proxy
    sends them on; unchanged without a mask."""
    if mask is None:
        return headers
    host = mask.replace("${PORT}", str(port)).encode("latin-1")
    return [*((k, v) for k, v in headers if k.lower() != b"host"), (b"host", host)]


# the resumes under way, (service, sandbox id) -> its task: concurrent requests for one paused sandbox wait on
# the one resume (the event loop's own; each server has one loop)
_waking: dict[tuple[int, str], asyncio.Future[str | None]] = {}


def _resume(service: Service, sandbox_id: str) -> str | None:
    """Resume the paused sandbox as connect does (``Service.resume``), its timeout its first one (five minutes at
    least); the state it is in after. A sandbox resumed meanwhile (by a connect) is left as it is."""
    sb = service.sandbox(sandbox_id)
    if sb.state != "paused":
        return sb.state
    snap_id = sb.paused_snapshot
    if snap_id is None or not Snapshot.get(snap_id).has_memory:
        return "paused"  # a files-only pause boots afresh, on Sandbox.connect only (as in E2B)
    try:
        service.resume(sandbox_id)
    except errors.SandboxStateError:
        return sb.state  # a connect or another server's request resumed it first
    except errors.AgentEnvError as e:
        raise Refused(502, f"The sandbox {sandbox_id} is paused and could not be resumed: {e}") from e
    sb.set_ttl(max(AUTO_RESUME_MIN_TTL, float(sb.labels.get(TIMEOUT_LABEL) or 0)))
    return "running"


async def wake(service: Service, sandbox_id: str) -> str | None:
    """Resume a paused sandbox for a request that came for it, once for all the requests that wait on it."""
    key = (id(service), sandbox_id)
    task = _waking.get(key)
    if task is None:
        task = asyncio.ensure_future(bridge.run(_resume, service, sandbox_id))
        _waking[key] = task
        task.add_done_callback(lambda _: _waking.pop(key, None))
    return await asyncio.shield(task)  # a client that leaves does not cut the resume short for the others


async def running(service: Service, sandbox_id: str) -> dict[str, str]:
    """The labels of the sandbox once it is recorded running, else ``Refused`` (502, as E2B); no ``runc state`` per
    request: a sandbox whose processes died behind the record fails its call with a typed error instead. A paused
    one made with ``lifecycle.auto_resume`` is resumed first (``wake``)."""
    def state() -> tuple[str | None, dict[str, str]]:
        try:
            sb = service.sandbox(sandbox_id)
            return sb.recorded_state, sb.labels
        except (errors.SandboxNotFound, ValueError):
            return None, {}

    now, labels = await bridge.run(state)
    if now == "paused" and labels.get(AUTO_RESUME_LABEL) == "true":
        now = await wake(service, sandbox_id)
    if now != "running":
        raise Refused(502, f"The sandbox {sandbox_id} was not found" if now is None else
                      f"The sandbox {sandbox_id} is {now}, so it was not found running: connect to it to resume it")
    return labels


def forwarded(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The request headers the listener gets: not the hop-by-hop ones, not E2B's routing ones."""
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP and k.lower() not in ROUTING]


def closed(sandbox_id: str, port: int) -> dict[str, Any]:
    """E2B's body for a port nothing listens on (its client proxy's words)."""
    return {"message": "The sandbox is running but port is not open", "sandboxId": sandbox_id, "port": port}


async def open_port(sb: Sandbox, port: int) -> socket.socket:
    """A connection to ``port`` in ``sb``; ``Refused`` (E2B's 502) when nothing listens or the sandbox is gone."""
    try:
        return await bridge.run(sb.open_port, port, OPEN_TIMEOUT)
    except errors.AgentEnvError as e:  # the keeper's failure (gone, starved, paused under the call), not the port's
        raise Refused(502, f"The sandbox {sb.id} cannot be reached: {e}", sandboxId=sb.id, port=port) from e
    except OSError as e:
        raise Refused(502, **closed(sb.id, port)) from e


async def proxy(sb: Sandbox, port: int, scope: Scope, receive: Receive, send: Send, mask: str | None = None) -> None:
    """Send the request to ``port`` of ``sb`` and stream its response back (a 502 when nothing listens); ``mask``:
    the sandbox's ``maskRequestHost``, the Host the request carries on."""
    try:
        sock = await open_port(sb, port)
    except Refused as e:
        await reply(send, e.status, e.message, **e.extra)
        return
    reader, writer = await asyncio.open_connection(sock=sock)
    started = False
    try:
        conn = h11.Connection(h11.CLIENT)
        headers = masked(forwarded(scope["headers"]), mask, port)
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
