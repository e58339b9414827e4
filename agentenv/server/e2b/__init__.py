"""E2B's API on the environment server: the official ``e2b`` and ``e2b-code-interpreter`` SDKs run unchanged
against ``agentenv serve`` with ``E2B_API_URL`` and ``E2B_SANDBOX_URL`` set to it and ``E2B_API_KEY`` to its
token.

With ``E2B_SANDBOX_URL`` set, the SDK sends everything meant for inside a sandbox (envd on port 49983, the code
interpreter on 49999) to that one URL, naming the sandbox and port in the ``E2b-Sandbox-Id`` and
``E2b-Sandbox-Port`` headers. So ``SandboxPorts`` routes on those headers before the path: such a request goes
to the port's app once one of the sandbox's tokens that opens that port checks out (``tokens``: envd's port takes
the envd token alone, any other port the traffic token) and the sandbox is running (a signed ``/files`` URL carries
no token and may name no sandbox: ``signed`` finds the sandbox its signature is of). A wrong token or signature
spends its sender's budget of failed authentication (``policy.authlimit``, the server's ``auth_failures``). Any
other port is proxied to what listens on it inside the sandbox (``ports``; WebSockets in ``upgrade``), and is also reached on
the Host names ``get_host`` builds (``{port}-{id}.{domain}``, with ``serve --domain``). Every other request
is the control plane's (``control``, under ``X-API-KEY``) or the native API's. Each part is an adapter over the
same ``Service`` and ``Sandbox`` as the native routes: there is no second sandbox model.

The envd services are the SDK's own generated Connect stubs (``e2b.envd``) served by ``connectrpc``, so the
protocol (envelopes, JSON codec, error codes, deadlines) is the one the SDK speaks, not a re-implementation.
"""

from __future__ import annotations

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

from agentenv.server.e2b import bridge, control, interpreter, listing, metrics, ports, templates, upgrade
from agentenv.server.e2b.files import FilesystemService, Uploads, files_routes
from agentenv.server.e2b.ports import Refused, admit, admitted_headers, reply, route_of, running
from agentenv.server.e2b.process import ProcessService
from agentenv.server.e2b.signed import SCOPE_KEY, sandbox_of, signed
from agentenv.server.e2b.tokens import ENVD_PORT, INTERPRETER_PORT, sent
from agentenv.server.service import Service
from policy.authlimit import Address, AuthFailures

__all__ = ["install"]

SCAN_THREADS = 2  # threads the signature scans of signed URLs may hold at once, over all sandboxes
MAX_LIMITERS = 4096  # sandboxes whose thread limiters are kept; the least recently used goes first
NATIVE_PATHS = ("/v1", "/health", "/metrics", "/openapi.json")  # the rest is E2B's


def install(app: FastAPI, service: Service, token: str, domain: str | None = None) -> None:
    """Serve E2B's control plane and in-sandbox ports on ``app`` (call before the body-limit middleware);
    ``domain``: the one ``get_host`` names (``{port}-{id}.{domain}``), routed on the ``Host`` header."""
    app.state.e2b_domain = domain
    failures: AuthFailures = app.state.auth_failures
    app.state.raw_upgrade = upgrade.Upgrades(service, token, domain, failures).take  # WebSockets: GuardedHttpProtocol
    app.include_router(listing.router)
    app.include_router(metrics.router)  # before control's /sandboxes/{id}, which would take /sandboxes/metrics
    app.include_router(control.router)
    app.include_router(templates.router)
    app.include_router(templates.uploads)
    codecs = [bridge.CheckedCodec(proto_binary_codec()), bridge.CheckedCodec(proto_json_codec())]
    process = ProcessASGIApplication(ProcessService(service), compressions=(), codecs=codecs)
    uploads = Uploads()
    filesystem = FilesystemASGIApplication(FilesystemService(service, uploads), compressions=(), codecs=codecs)
    envd = Router(routes=[Mount(process.path, app=process), Mount(filesystem.path, app=filesystem),
                          Mount("", app=files_routes(service, uploads))])
    app.add_middleware(SandboxPorts, service=service, token=token, domain=domain, failures=failures,
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
    """ASGI middleware: requests naming a sandbox in their headers or Host go to that sandbox's port (see above)."""

    def __init__(self, app: ASGIApp, service: Service, token: str, ports: dict[int, ASGIApp], failures: AuthFailures,
                 domain: str | None = None) -> None:
        self.app, self.service, self.token, self.ports, self.domain = app, service, token, ports, domain
        self.failures = failures
        self.limiters: OrderedDict[str, CapacityLimiter] = OrderedDict()
        # signed URLs name no sandbox: their scans (a hash per sandbox) run in threads of their own, so a flood of
        # bogus signatures, which needs no token, takes neither the control plane's threads nor a sandbox's
        self.scans = CapacityLimiter(SCAN_THREADS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        route = route_of(headers, self.domain)
        # a signature is envd's only: another port's /files?signature= is its listener's (a public port's, say)
        is_signed = signed(scope["path"], scope.get("query_string", b"")) and (route is None or
                                                                             route[1] == str(ENVD_PORT))
        if route is None and not is_signed:
            await self.app(scope, receive, send)
            return
        peer = (scope.get("client"), scope.get("server"))
        try:
            if is_signed and not sent(headers):
                sid, port = await self._signed(scope, route, peer)
                scope = {**scope, SCOPE_KEY: True, ports.CREDENTIAL: "signed"}
            else:
                sid, port, credential = await admit(self.service, scope["headers"], route or ("", str(ENVD_PORT)),
                                                    self.token, self.failures, peer)
                scope = {**scope, ports.CREDENTIAL: credential}
        except Refused as e:
            await reply(send, e.status, e.message, e.headers)
            return
        if b"e2b-sandbox-id" not in headers:  # routed on Host or a signature: the services behind read this header
            scope = {**scope, "headers": [*scope["headers"], (b"e2b-sandbox-id", sid.encode())]}
        reset = bridge.threads.set(self._limiter(sid))
        try:
            try:
                labels = await running(self.service, sid)
            except Refused as e:
                await reply(send, e.status, e.message)
                return
            target = self.ports.get(port)
            if target is not None:
                await target(scope, receive, send)
            else:
                await ports.proxy(self.service.sandbox(sid), port, scope, receive, send, labels.get(ports.MASK_LABEL))
        finally:
            bridge.threads.reset(reset)

    async def _signed(self, scope: Scope, route: tuple[str, str] | None,
                      peer: tuple[Address | None, Address | None]) -> tuple[str, int]:
        """The sandbox of a signed ``/files`` URL for envd's port (``signed``): only the one sandbox where the
        request names it. A signature that opens none spends the peer's budget, as a wrong token does."""
        admitted_headers(scope["headers"])
        if any(k.lower() == b"authorization" for k, _ in scope["headers"]):
            raise Refused(401, "a signed URL acts as the account it was signed for: send it with no Authorization "
                               "header (which names another)")
        who = ports.budget(self.failures, peer, True)
        reset = bridge.threads.set(self.scans)
        try:
            sid = await bridge.run(sandbox_of, scope["method"], scope.get("query_string", b""), self.token,
                                   None if route is None else route[0])
        except Refused:
            self.failures.failed(*peer, who)
            raise
        finally:
            bridge.threads.reset(reset)
        return sid, ENVD_PORT

    def _limiter(self, sandbox_id: str) -> CapacityLimiter:
        """The threads this sandbox's requests may hold (``bridge.run``), made on its first request."""
        limiter = self.limiters.pop(sandbox_id, None) or CapacityLimiter(bridge.THREADS)
        self.limiters[sandbox_id] = limiter
        while len(self.limiters) > MAX_LIMITERS:
            self.limiters.popitem(last=False)
        return limiter
