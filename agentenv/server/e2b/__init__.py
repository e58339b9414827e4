"""E2B's API on the environment server: the official ``e2b`` and ``e2b-code-interpreter`` SDKs run unchanged
against ``agentenv serve`` with ``E2B_API_URL`` and ``E2B_SANDBOX_URL`` set to it and ``E2B_API_KEY`` to its
token.

With ``E2B_SANDBOX_URL`` set, the SDK sends everything meant for inside a sandbox (envd on port 49983, the code
interpreter on 49999) to that one URL, naming the sandbox and port in the ``E2b-Sandbox-Id`` and
``E2b-Sandbox-Port`` headers. So ``SandboxPorts`` routes on those headers before the path: such a request goes
to the port's app once its per-sandbox access token checks out and the sandbox is running; every other request
is the control plane's (``control``, under ``X-API-KEY``) or the native API's. Each part is an adapter over the
same ``Service`` and ``Sandbox`` as the native routes: there is no second sandbox model.

The envd services are the SDK's own generated Connect stubs (``e2b.envd``) served by ``connectrpc``, so the
protocol (envelopes, JSON codec, error codes, deadlines) is the one the SDK speaks, not a re-implementation.
"""

from __future__ import annotations

import json
from collections import OrderedDict

from anyio import CapacityLimiter
from connectrpc.codec import proto_binary_codec, proto_json_codec
from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from e2b.envd.process.process_connect import ProcessASGIApplication
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse
from starlette.routing import Mount, Router
from starlette.types import ASGIApp, Receive, Scope, Send

from agentenv import errors
from agentenv.server.e2b import bridge, control, interpreter
from agentenv.server.e2b.files import FilesystemService, files_routes
from agentenv.server.e2b.process import ProcessService
from agentenv.server.e2b.tokens import ENVD_PORT, INTERPRETER_PORT, valid
from agentenv.server.service import Service

__all__ = ["install"]

# the headers that say which sandbox, port and token a request is for: each may come once (the checks here read
# one value, the services behind another, so a second copy could name a sandbox whose token was never checked)
ROUTING = (b"e2b-sandbox-id", b"e2b-sandbox-port", b"x-access-token", b"e2b-traffic-access-token")
MAX_LIMITERS = 4096  # sandboxes whose thread limiters are kept; the least recently used goes first
NATIVE_PATHS = ("/v1", "/health", "/metrics", "/openapi.json", "/docs", "/redoc")  # the rest is E2B's


def install(app: FastAPI, service: Service, token: str) -> None:
    """Serve E2B's control plane and in-sandbox ports on ``app`` (call before the body-limit middleware)."""
    app.include_router(control.router)
    codecs = [bridge.CheckedCodec(proto_binary_codec()), bridge.CheckedCodec(proto_json_codec())]
    process = ProcessASGIApplication(ProcessService(service), compressions=(), codecs=codecs)
    filesystem = FilesystemASGIApplication(FilesystemService(service), compressions=(), codecs=codecs)
    envd = Router(routes=[Mount(process.path, app=process), Mount(filesystem.path, app=filesystem),
                          Mount("", app=files_routes(service))])
    app.add_middleware(SandboxPorts, service=service, token=token,
                       ports={ENVD_PORT: envd, INTERPRETER_PORT: interpreter.routes(service)})
    app.state.e2b_errors = unknown_route


def unknown_route(request: Request, exc: StarletteHTTPException) -> JSONResponse | None:
    """A 404 for a path of E2B's control plane that no route serves, in E2B's ``{code, message}`` (which the
    SDK parses; the native body would fail it with a KeyError); None for the native API's paths and other errors."""
    path = request.url.path
    if exc.status_code != 404 or any(path == p or path.startswith(p + "/") for p in NATIVE_PATHS):
        return None
    return JSONResponse({"code": 404, "message": f"{request.method} {path} is not served here (no such route)"},
                        404)


class SandboxPorts:
    """ASGI middleware: requests naming a sandbox in their headers go to that sandbox's port (see above)."""

    def __init__(self, app: ASGIApp, service: Service, token: str, ports: dict[int, ASGIApp]) -> None:
        self.app, self.service, self.token, self.ports = app, service, token, ports
        self.limiters: OrderedDict[str, CapacityLimiter] = OrderedDict()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        sandbox_id = headers.get(b"e2b-sandbox-id")
        if sandbox_id is None:
            await self.app(scope, receive, send)
            return
        names = [k.lower() for k, _ in scope["headers"]]
        repeated = [k.decode() for k in ROUTING if names.count(k) > 1]
        if repeated:
            await _reply(send, 400, f"the header {repeated[0]} is given more than once")
            return
        sid = sandbox_id.decode("latin-1")
        port = headers.get(b"e2b-sandbox-port", str(ENVD_PORT).encode()).decode("latin-1")
        given = (headers.get(b"x-access-token") or headers.get(b"e2b-traffic-access-token") or b"").decode("latin-1")
        if not valid(self.token, sid, given):
            await _reply(send, 401, f"missing or wrong access token for sandbox {sid} (X-Access-Token)")
            return
        target = self.ports.get(int(port)) if port.isascii() and port.isdigit() and len(port) <= 5 else None
        if target is None:
            await _reply(send, 502, f"The sandbox {sid} is running but port {port[:16]} is not open (port is not open)")
            return
        reset = bridge.threads.set(self._limiter(sid))
        try:
            state = await bridge.run(self._state, sid)
            if state != "running":
                await _reply(send, 502, f"The sandbox {sid} was not found" if state is None else
                             f"The sandbox {sid} is {state}, so it was not found running: connect to it to resume it")
                return
            await target(scope, receive, send)
        finally:
            bridge.threads.reset(reset)

    def _limiter(self, sandbox_id: str) -> CapacityLimiter:
        """The threads this sandbox's requests may hold (``bridge.run``), made on its first request."""
        limiter = self.limiters.pop(sandbox_id, None) or CapacityLimiter(bridge.THREADS)
        self.limiters[sandbox_id] = limiter
        while len(self.limiters) > MAX_LIMITERS:
            self.limiters.popitem(last=False)
        return limiter

    def _state(self, sandbox_id: str) -> str | None:
        """The sandbox's recorded state (no ``runc state`` per request: a sandbox whose processes died behind
        the record fails its call with a typed error instead)."""
        try:
            return self.service.sandbox(sandbox_id).recorded_state
        except (errors.SandboxNotFound, ValueError):
            return None


async def _reply(send: Send, status: int, message: str) -> None:
    body = json.dumps({"code": status, "message": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
