"""The environment server's app: the service, the routers and the error handlers put together; and running it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentenv import __version__, store
from agentenv.config import parse_size
from agentenv.server.limits import MAX_CONNECTIONS, BodyLimit, GuardedHttpProtocol
from agentenv.server.routes import commands, files, sandboxes, server, snapshots
from agentenv.server.routing import (
    WireResponse,
    complete_openapi,
    http_error_response,
    invalid_response,
    replying_as,
)
from agentenv.server.service import Service

DEFAULT_PORT = 8700
TOKEN_ENV = "AGENTENV_TOKEN"


def create_app(token: str, *, max_sandboxes: int = 64, max_memory: str | int = "64g", max_disk: str | int = "640g",
               max_store: str | int | None = None, unlimited_disk: bool = False,
               reap_interval: float = 5.0) -> FastAPI:
    """The environment server's app; ``token`` guards every route but /health and /metrics.

    Quotas: ``max_sandboxes`` live sandboxes, ``max_memory`` and ``max_disk`` bytes of their limits added up;
    ``max_store`` (if given) becomes the snapshot store's limit; ``unlimited_disk`` lets clients ask for
    sandboxes without a disk limit (``disk: null``).
    """
    if not token:
        raise ValueError("the server needs a bearer token (--token-file or $AGENTENV_TOKEN)")
    service = Service(max_sandboxes, parse_size(max_memory), reap_interval, max_disk=parse_size(max_disk),
                      unlimited_disk=unlimited_disk)
    store_limit = None if max_store is None else parse_size(max_store)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if store_limit is not None:
            await run_in_threadpool(store.set_limit, store_limit)
        await run_in_threadpool(service.recover)
        service.start_reaper()
        yield
        service.stop()

    app = FastAPI(title="agentenv environment server", version=__version__, lifespan=lifespan,
                  description="Sandboxes that snapshot, fork and resume, over HTTP. Bodies are JSON or msgpack "
                              "(Content-Type / Accept: application/msgpack).",
                  default_response_class=WireResponse)
    app.state.service = service
    app.state.expected_auth = f"Bearer {token}".encode()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return http_error_response(exc, request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        with replying_as(request):
            return invalid_response(exc)

    for module in (server, sandboxes, commands, files, snapshots):
        app.include_router(module.router)
    app.add_middleware(BodyLimit)
    complete_openapi(app)
    return app


def load_token(token_file: Path | None) -> str:
    """The bearer token from ``token_file``, else $AGENTENV_TOKEN; ValueError when there is none."""
    token = token_file.read_text().strip() if token_file is not None else os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(f"no token: pass --token-file or set ${TOKEN_ENV} (the server never runs open)")
    return token


def uvicorn_config(app: FastAPI, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                   log_level: str = "info") -> uvicorn.Config:
    """How the server is run: one process, the guarded HTTP protocol, a connection limit, short keep-alive."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          http=GuardedHttpProtocol, limit_concurrency=MAX_CONNECTIONS, timeout_keep_alive=5)


def serve(token: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *, max_sandboxes: int = 64,
          max_memory: str | int = "64g", max_disk: str | int = "640g", max_store: str | int | None = None,
          unlimited_disk: bool = False, reap_interval: float = 5.0, log_level: str = "info") -> None:
    """Run the server until interrupted (sandbox calls run in uvicorn's thread pool)."""
    app = create_app(token, max_sandboxes=max_sandboxes, max_memory=max_memory, max_disk=max_disk,
                     max_store=max_store, unlimited_disk=unlimited_disk, reap_interval=reap_interval)
    uvicorn.Server(uvicorn_config(app, host, port, log_level)).run()
