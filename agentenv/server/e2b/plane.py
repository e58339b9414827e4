"""What every route of E2B's control plane stands on (``control``, ``listing``, ``metrics``, ``templates``): its
errors answered as E2B's ``{code, message}`` with their status (a full quota a 429 with ``Retry-After``, which the
SDK retries), the API key checked on every call, the route class and router that apply both, the ``Service`` a
route uses, and E2B's way of writing a time. Apart from ``control`` because the other routers share it; the
routes themselves say what maps to what.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from agentenv import errors
from agentenv.server.service import Service
from policy.authlimit import AuthFailures, Spent


class E2BError(Exception):
    """An error answered as E2B's ``{code, message}`` with that HTTP status."""

    def __init__(self, code: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.headers = code, message, headers or {}


def error_response(exc: BaseException) -> JSONResponse:
    """The ``{code, message}`` reply of any exception a route raised (500 for bugs, without a retry)."""
    if not isinstance(exc, E2BError):
        exc = as_e2b_error(exc)
    return JSONResponse({"code": exc.code, "message": exc.message}, exc.code, headers=exc.headers)


def as_e2b_error(exc: BaseException) -> E2BError:
    status = errors.status_of(exc) or 500
    headers = {"Should-Retry": "false"} if status >= 500 else {}
    if isinstance(exc, errors.QuotaExceeded):
        headers = {"Retry-After": str(int(exc.retry_after + 0.999))}
    return E2BError(status, str(exc), headers)


def api_key(request: Request) -> None:
    """The SDK sends the API key as ``X-API-KEY``; it is the server's token (a bearer token works too). A wrong one
    spends its sender's budget of failed authentication (``policy.authlimit``): a 429 once it is spent."""
    token: str = request.app.state.token
    given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
    failures: AuthFailures = request.app.state.auth_failures
    try:
        right = failures.matches(request.scope, given.encode(), token.encode())
    except Spent as e:
        raise E2BError(429, str(e), {"Retry-After": str(e.seconds)}) from None
    if not right:
        raise E2BError(401, "Invalid API key: set E2B_API_KEY to the agentenv server's token")


class E2BRoute(APIRoute):
    """A route that answers every failure as E2B's ``{code, message}`` (bad input: 400, as E2B's API does)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def e2b_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                return error_response(E2BError(400, "; ".join(f"{'.'.join(map(str, err.get('loc', ())))}: "
                                                              f"{err.get('msg')}" for err in e.errors())))
            except Exception as e:  # noqa: BLE001 - mapped to E2B's error body
                return error_response(e)

        return e2b_handler


def router_for() -> APIRouter:
    """A router of E2B's control plane: under the API key, every failure as E2B's ``{code, message}``."""
    return APIRouter(tags=["e2b"], dependencies=[Depends(api_key)], include_in_schema=False, route_class=E2BRoute)


def _service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


ServiceDep = Annotated[Service, Depends(_service)]


def e2b_time(t: float | None) -> str:
    """A time as E2B writes one: ISO 8601 in UTC, with ``Z``."""
    stamp = dt.datetime.fromtimestamp(t or 0, dt.UTC)
    return stamp.isoformat().replace("+00:00", "Z")
