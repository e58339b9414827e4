"""The environment server's app: the service, the routers and the error handlers put together; and running it."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentenv import __version__
from agentenv.api import DEFAULT_DISK, DEFAULT_IMAGE
from agentenv.config import parse_size
from agentenv.host.image_store import ImageSources
from agentenv.sandbox import warm
from agentenv.server import console
from agentenv.server.limits import MAX_CONNECTIONS, BodyLimit, GuardedHttpProtocol
from agentenv.server.routes import commands, files, images, jobs, migration, sandboxes, server, snapshots
from agentenv.server.routing import (
    WireResponse,
    complete_openapi,
    http_error_response,
    invalid_response,
    replying_as,
)
from agentenv.server.service import Service
from agentenv.snapshot import shared, store, trust
from policy.authlimit import AuthFailures

DEFAULT_PORT = 8700
DEFAULT_MEMORY = 1 << 30  # what a create that names no memory gets (Sandbox.create's default)
TOKEN_ENV = "AGENTENV_TOKEN"


def create_app(token: str, *, max_sandboxes: int = 64, max_memory: str | int = "64g", max_disk: str | int = "640g",
               max_store: str | int | None = None, unlimited_disk: bool = False,
               reap_interval: float = 5.0, e2b: bool | None = None, warm_pool: int = 0,
               domain: str | None = None, shared_store: str | Path | None = None,
               transfer_key: str | Path | None = None, pages: Sequence[Callable[[FastAPI], None]] = (),
               image_mirrors: Sequence[str] | None = None, image_tarballs: str | None = None,
               image_pull: bool | None = None, pull_deadline: float | None = None) -> FastAPI:
    """The environment server's app; ``token`` guards every route but /health and /metrics (and /openapi.json,
    the spec: there is no docs page).

    Quotas: ``max_sandboxes`` live sandboxes, ``max_memory`` and ``max_disk`` bytes of their limits added up;
    ``max_store`` (if given) becomes the snapshot store's limit; ``unlimited_disk`` lets clients ask for
    sandboxes without a disk limit (``disk: null``); ``e2b`` serves E2B's API too (``agentenv.server.e2b``):
    None = when the ``e2b`` package is installed. ``warm_pool`` sandboxes of the default image and limits (what
    E2B's creates and plain creates ask for) are kept started, so that a burst of creates gets them at once.
    ``domain``: what E2B's ``get_host`` names (``{port}-{id}.{domain}``): requests with such a ``Host`` reach
    that port of the sandbox (a wildcard DNS name to this server makes them work, see docs/e2b.md).
    ``shared_store``: a folder every server sees, where each pause and snapshot is also published and from which
    a snapshot this store lacks is imported (``agentenv.snapshot.shared``). ``transfer_key``: the file of the key the
    servers that exchange snapshots share (``agentenv.snapshot.trust``; None: ``$AGENTENV_TRANSFER_KEY_FILE``, else
    the home's own key, which only servers of this home share). ``pages``: what other packages add to the
    console, each called with the app before the console's own pages (``agentenv serve --runs``: the trajectory
    viewer, found through the ``agentenv.console`` entry points: agentenv imports no other package).
    ``image_mirrors``, ``image_tarballs``, ``image_pull``, ``pull_deadline``: where ``/v1/images/ensure`` finds an
    image this host lacks (``agentenv.host.image_store.ImageSources``; each None: from the environment).
    """
    if not token:
        raise ValueError("the server needs a bearer token (--token-file or $AGENTENV_TOKEN)")
    trust.configure(transfer_key)
    shared.configure(shared_store)
    service = Service(max_sandboxes, parse_size(max_memory), reap_interval, max_disk=parse_size(max_disk),
                      unlimited_disk=unlimited_disk)
    store_limit = None if max_store is None else parse_size(max_store)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if store_limit is not None:
            await run_in_threadpool(store.set_limit, store_limit)
        await run_in_threadpool(service.recover)
        service.start_reaper()
        if warm_pool:
            warm.configure(DEFAULT_IMAGE, warm_pool, memory=DEFAULT_MEMORY, disk=DEFAULT_DISK)
        yield
        service.stop()
        if warm_pool:
            await run_in_threadpool(warm.drain)

    # no docs pages: FastAPI's load Swagger UI and ReDoc from a CDN, on the console's origin; the spec they draw is
    # /openapi.json, for whichever viewer one runs elsewhere
    app = FastAPI(title="agentenv environment server", version=__version__, lifespan=lifespan,
                  description="Sandboxes that snapshot, fork and resume, over HTTP. Bodies are JSON or msgpack "
                              "(Content-Type / Accept: application/msgpack).",
                  default_response_class=WireResponse, docs_url=None, redoc_url=None)
    app.state.service = service
    env_sources = ImageSources.from_env()
    app.state.image_sources = ImageSources(
        mirrors=tuple(image_mirrors) if image_mirrors is not None else env_sources.mirrors,
        tarballs=image_tarballs if image_tarballs is not None else env_sources.tarballs,
        pull=image_pull if image_pull is not None else env_sources.pull,
        deadline=pull_deadline if pull_deadline is not None else env_sources.deadline)
    app.state.expected_auth = f"Bearer {token}".encode()
    app.state.token = token
    app.state.auth_failures = AuthFailures()  # every check of a credential: the bearer, the console's, E2B's

    app.state.e2b_errors = None  # E2B's error reply for its own paths, once its API is installed

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        e2b_errors = request.app.state.e2b_errors
        if e2b_errors is not None and (reply := e2b_errors(request, exc)) is not None:
            return reply
        return http_error_response(exc, request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        with replying_as(request):
            return invalid_response(exc)

    for module in (server, sandboxes, commands, jobs, files, snapshots, migration, images):
        app.include_router(module.router)
    for install in pages:  # before the console's /console/{page}, which would take their paths
        install(app)
    console.install(app)  # the web console under /console (its own login: agentenv.server.console)
    if e2b is None:
        e2b = importlib.util.find_spec("e2b") is not None
    if domain is not None and not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[0-9]{1,5})?", domain):
        raise ValueError(f"--domain {domain!r} is not a host name (as sandbox.test, or sandbox.test:8700)")
    if domain and not e2b:
        raise ValueError("--domain names E2B's sandbox hosts: it needs the E2B API (--e2b)")
    if e2b:
        try:
            from agentenv.server import e2b as e2b_api
        except ImportError as e:
            raise ValueError(f"the E2B API needs the e2b package ({e}): pip install -e '.[e2b]' in the checkout") from e
        e2b_api.install(app, service, token, domain)
    app.add_middleware(BodyLimit)
    complete_openapi(app)
    return app


def new_token() -> str:
    """A fresh token in the shape of E2B's API keys (``e2b_`` and 40 hex digits), so that E2B SDKs that check
    the shape on the client accept it as ``E2B_API_KEY``."""
    return "e2b_" + secrets.token_hex(20)


def load_token(token_file: Path | None) -> str:
    """The bearer token from ``token_file`` (made with ``new_token``, readable by its owner only, when the file
    does not exist yet), else $AGENTENV_TOKEN; ValueError when there is none. A token of any other shape works."""
    if token_file is not None and not token_file.exists():
        with contextlib.suppress(FileExistsError):  # another process made it first: read theirs
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(new_token() + "\n")
    token = token_file.read_text().strip() if token_file is not None else os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(f"no token: pass --token-file or set ${TOKEN_ENV} (the server never runs open)")
    return token


def uvicorn_config(app: FastAPI, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                   log_level: str = "info") -> uvicorn.Config:
    """How the server is run: one process, the guarded HTTP protocol, a connection limit, short keep-alive, and the
    client a request came from as its connection says, never as an X-Forwarded-For header claims (uvicorn believes
    that header from any process on loopback, which would hand each of its requests a budget of failed
    authentication of its own: ``policy.authlimit``; and the origin the console checks is the scheme served)."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          http=GuardedHttpProtocol, limit_concurrency=MAX_CONNECTIONS, timeout_keep_alive=5,
                          proxy_headers=False)


def serve(token: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *, max_sandboxes: int = 64,
          max_memory: str | int = "64g", max_disk: str | int = "640g", max_store: str | int | None = None,
          unlimited_disk: bool = False, reap_interval: float = 5.0, log_level: str = "info",
          e2b: bool | None = None, warm_pool: int = 0, domain: str | None = None,
          shared_store: str | Path | None = None, transfer_key: str | Path | None = None,
          pages: Sequence[Callable[[FastAPI], None]] = (), image_mirrors: Sequence[str] | None = None,
          image_tarballs: str | None = None, image_pull: bool | None = None,
          pull_deadline: float | None = None) -> None:
    """Run the server until interrupted (sandbox calls run in uvicorn's thread pool)."""
    app = create_app(token, max_sandboxes=max_sandboxes, max_memory=max_memory, max_disk=max_disk,
                     max_store=max_store, unlimited_disk=unlimited_disk, reap_interval=reap_interval, e2b=e2b,
                     warm_pool=warm_pool, domain=domain, shared_store=shared_store, transfer_key=transfer_key,
                     pages=pages, image_mirrors=image_mirrors, image_tarballs=image_tarballs, image_pull=image_pull,
                     pull_deadline=pull_deadline)
    uvicorn.Server(uvicorn_config(app, host, port, log_level)).run()
