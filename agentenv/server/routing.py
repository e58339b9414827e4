"""How every route of the server speaks: the bearer token checked first (in constant time, before the
body is read; a wrong one spends its sender's budget of failed authentication, ``policy.authlimit``, and a spent
one is a 429 before any check), msgpack or JSON bodies, replies in the format the Accept header asked for,
exceptions mapped to typed error bodies (``agentenv.errors.to_wire``), and a latency histogram per route.

Routes get this by being declared on a router with ``route_class=WireRoute``; the token and the
service are read from ``app.state``, so the routers can be module-level.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from agentenv import errors, wire
from agentenv.server.limits import BodyTooLarge, too_large_body
from agentenv.server.service import RETRY_AFTER
from policy.authlimit import AuthFailures, Spent

log = logging.getLogger("agentenv.server")
OPEN_PATHS = frozenset({"/health", "/metrics"})

_msgpack_reply: contextvars.ContextVar[bool] = contextvars.ContextVar("agentenv_msgpack_reply", default=False)


def reply_in_msgpack() -> bool:
    """Whether the request being served asked for msgpack replies."""
    return _msgpack_reply.get()


@contextlib.contextmanager
def replying_as(request: Request) -> Iterator[None]:
    """Reply in the format ``request`` asked for (for handlers outside a WireRoute)."""
    token = _msgpack_reply.set(wire.wants_msgpack(request.headers.get("accept")))
    try:
        yield
    finally:
        _msgpack_reply.reset(token)


class WireResponse(Response):
    """A response in msgpack or JSON, whichever the request's Accept header asked for."""

    def __init__(self, content: Any, status_code: int = 200, headers: dict[str, str] | None = None,
                 msgpack_body: bool | None = None) -> None:
        mp = _msgpack_reply.get() if msgpack_body is None else msgpack_body
        super().__init__(content=wire.encode(content, mp), status_code=status_code, headers=headers,
                         media_type=wire.MSGPACK if mp else wire.JSON)


def error_response(exc: BaseException, request: Request) -> Response:
    if isinstance(exc, StarletteHTTPException):
        return http_error_response(exc, request)
    code = errors.status_of(exc)
    if code is None:
        log.exception("unexpected error in %s %s", request.method, request.url.path, exc_info=exc)
        code = 500
    subject = request.path_params.get("sandbox_id") or request.path_params.get("snapshot_id")
    headers = {"Retry-After": f"{getattr(exc, 'retry_after', RETRY_AFTER):.0f}"} if code == 429 else None
    if code == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return WireResponse(errors.to_wire(exc, subject), code, headers,
                        msgpack_body=wire.wants_msgpack(request.headers.get("accept")))


def http_error_response(exc: StarletteHTTPException, request: Request) -> Response:
    """Starlette's own errors (unknown route, method not allowed, unparsable body) in the same error format."""
    if isinstance(exc, BodyTooLarge):
        return WireResponse(too_large_body(exc.limit), 413, {"Connection": "close"},
                            msgpack_body=wire.wants_msgpack(request.headers.get("accept")))
    headers = dict(exc.headers or {})
    if exc.status_code == 405:  # Starlette names the first matching route's methods only: name them all
        methods = {m for r in request.app.routes if isinstance(r, APIRoute)
                   and r.matches(request.scope)[0] != Match.NONE for m in (r.methods or ())}
        headers["Allow"] = ", ".join(sorted(methods))
    return WireResponse({"error": "HTTPError", "message": str(exc.detail), "fix": None, "id": None},
                        exc.status_code, headers,
                        msgpack_body=wire.wants_msgpack(request.headers.get("accept")))


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for e in exc.errors():
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def invalid_response(exc: RequestValidationError) -> Response:
    return WireResponse({"error": "ValidationError", "message": _validation_message(exc),
                         "fix": "see the OpenAPI spec at /openapi.json", "id": None}, 422)


def bearer_checked(request: Request) -> None:
    """``Unauthorized`` unless the request carries the server's bearer token; ``QuotaExceeded`` (429) without a look
    at it while its sender's budget of failed authentication is spent (``app.state.auth_failures``)."""
    given = request.headers.get("authorization", "").encode()
    failures: AuthFailures = request.app.state.auth_failures
    try:
        right = failures.matches(request.scope, given, request.app.state.expected_auth)
    except Spent as e:
        raise errors.QuotaExceeded(str(e), retry_after=e.seconds, fix="send the right token once Retry-After has "
                                                                      "passed, and stop what sends a wrong one") from None
    if not right:
        raise errors.Unauthorized("missing or wrong bearer token", fix="send 'Authorization: Bearer <token>'")


class WireRoute(APIRoute):
    """A route that checks the token, decodes msgpack bodies, replies in the negotiated format and times itself."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        needs_auth = self.path not in OPEN_PATHS
        decodes = self.body_field is not None
        op = self.name

        async def wire_handler(request: Request) -> Response:
            started = time.perf_counter()
            reset = _msgpack_reply.set(wire.wants_msgpack(request.headers.get("accept")))
            try:
                if needs_auth:
                    bearer_checked(request)
                if decodes and wire.is_msgpack(request.headers.get("content-type")):
                    body = await request.body()
                    request._json = wire.decode(body, wire.MSGPACK) if body else None
                    request.scope["headers"] = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
                    request.scope["headers"].append((b"content-type", wire.JSON.encode()))
                    with contextlib.suppress(AttributeError):
                        del request._headers
                return await handler(request)
            except RequestValidationError as e:
                return invalid_response(e)
            except Exception as e:  # noqa: BLE001 - mapped to a typed error response
                return error_response(e, request)
            finally:
                _msgpack_reply.reset(reset)
                request.app.state.service.metrics.observe(op, time.perf_counter() - started)

        return wire_handler


def complete_openapi(app: FastAPI) -> None:
    """Say in the OpenAPI spec what the route class does: the bearer token, and msgpack wherever JSON goes."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = base()
        spec.setdefault("components", {})["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "the server's token"}}
        for path, item in spec.get("paths", {}).items():
            for op in item.values():
                if path not in OPEN_PATHS:  # checked by the route class, before the body is even read
                    op["security"] = [{"bearer": []}]
                targets = [op.get("requestBody", {})] + list(op.get("responses", {}).values())
                for t in targets:
                    content = t.get("content", {})
                    if wire.JSON in content and wire.MSGPACK not in content:
                        content[wire.MSGPACK] = content[wire.JSON]
        app.openapi_schema = spec
        return spec

    app.openapi = openapi  # type: ignore[method-assign]
