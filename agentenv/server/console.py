"""The web console under ``/console``: the sandboxes (state, CPU, memory, disk, live over server-sent events), the
snapshots' fork tree, and buttons that pause, resume, fork, snapshot and close a sandbox; a sandbox's own page
and the server's figures are ``console_sandbox``'s and ``console_metrics``'.

Behind the server's token: the login page takes it and sets a cookie holding a random session id (never the
token), scoped to ``/console`` (HttpOnly, SameSite=Strict). The cookie opens the console only: the API routes
check the bearer header alone, so no page elsewhere can ride the cookie into them. The console's actions call the
API's own route functions (``routes/sandboxes.py``, ``routes/snapshots.py``), so they pass the same checks and
quotas; they also need a header that a cross-site form cannot send, and a same-origin ``Origin`` when one is sent.
Sandbox-made text (labels, image names) only ever reaches the page as text (``textContent``), under a CSP that
allows this server's own scripts alone.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, RedirectResponse, StreamingResponse

from agentenv.sandbox import usage
from agentenv.sandbox.core import Sandbox
from agentenv.sandbox.store import Snapshot
from agentenv.server import console_metrics
from agentenv.server.routes import sandboxes, snapshots
from agentenv.server.routing import error_response
from agentenv.server.schemas import ForkRequest, SandboxId, SnapshotRequest
from agentenv.server.service import Service

PREFIX = "/console"
COOKIE = "agentenv_console"
SESSION_SECONDS = 12 * 3600
MAX_SESSIONS = 256  # the oldest session is dropped past this many logins
TICK = 1.0  # seconds between two readings on an event stream
STREAM_SECONDS = 15.0  # an event stream ends after this long (the browser reconnects), so none holds a shutdown up
MAX_STREAMS = 16  # event streams open at once
ACTION_HEADER = "x-agentenv-console"
STATIC = Path(__file__).with_name("console_static")
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css"}
PAGES = {"": "sandboxes.html", "snapshots": "snapshots.html", "server": "server.html"}
HEADERS = {  # on every console reply
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

router = APIRouter(prefix=PREFIX, include_in_schema=False)
auth = APIRouter(prefix=PREFIX, include_in_schema=False)  # login, logout, scripts: shared with trainer.viewer_web


class Sessions:
    """The logged-in console sessions: random ids, each valid for SESSION_SECONDS (a restart logs everyone out)."""

    def __init__(self) -> None:
        self._expiry: dict[str, float] = {}
        self._lock = threading.Lock()
        self.streams = 0

    def new(self) -> str:
        sid = secrets.token_urlsafe(32)
        with self._lock:
            now = time.monotonic()
            self._expiry = {k: t for k, t in self._expiry.items() if t > now}
            while len(self._expiry) >= MAX_SESSIONS:
                del self._expiry[next(iter(self._expiry))]
            self._expiry[sid] = now + SESSION_SECONDS
        return sid

    def valid(self, sid: str | None) -> bool:
        with self._lock:
            return sid is not None and self._expiry.get(sid, 0.0) > time.monotonic()

    def end(self, sid: str | None) -> None:
        with self._lock:
            self._expiry.pop(sid or "", None)


def install(app: Any) -> None:
    """Serve the console on ``app`` (made by ``create_app``, whose state holds the token and the service)."""
    app.state.console_sessions = Sessions()
    app.state.console_readings = Readings(app.state.service)
    app.include_router(auth)
    app.include_router(router)
    from agentenv.server import console_sandbox  # it uses this module's login and headers

    app.include_router(console_sandbox.router)


def _sessions(request: Request) -> Sessions:
    found: Sessions = request.app.state.console_sessions
    return found


def _logged_in(request: Request) -> bool:
    return _sessions(request).valid(request.cookies.get(COOKIE))


def _file(name: str, status: int = 200, replace: tuple[str, str] | None = None) -> Response:
    text = (STATIC / name).read_text()
    if replace is not None:
        text = text.replace(*replace)
    return Response(text, status, headers=HEADERS, media_type=TYPES[Path(name).suffix])


def _unauthorized() -> Response:
    return JSONResponse({"error": "Unauthorized", "message": "not logged in to the console",
                         "fix": f"log in at {PREFIX}/login with the server's token", "id": None}, 401, HEADERS)


# --- login ------------------------------------------------------------------------------------


@auth.get("/login")
def login_page() -> Response:
    return _file("login.html")


@auth.post("/login")
async def login(request: Request) -> Response:
    """Check the token a login form sent (urlencoded ``token``); on a match, a session cookie and the console."""
    body = await request.body()
    given = parse_qs(body.decode("utf-8", "replace")).get("token", [""])[0].strip()
    if not hmac.compare_digest(given.encode(), request.app.state.token.encode()):
        return _file("login.html", 401, ('<p id="error" hidden>', '<p id="error">'))
    reply = RedirectResponse(f"{PREFIX}/", 303, headers=HEADERS)
    reply.set_cookie(COOKIE, _sessions(request).new(), max_age=SESSION_SECONDS, path=PREFIX, httponly=True,
                     samesite="strict", secure=request.url.scheme == "https")
    return reply


@auth.post("/logout")
def logout(request: Request) -> Response:
    _sessions(request).end(request.cookies.get(COOKIE))
    reply = RedirectResponse(f"{PREFIX}/login", 303, headers=HEADERS)
    reply.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
    return reply


# --- pages and their scripts ------------------------------------------------------------------


@auth.get("/static/{name}")
def static(name: str) -> Response:
    """The console's scripts and style (nothing secret: they hold no data), by name from the package only."""
    if name not in {p.name for p in STATIC.iterdir()} or Path(name).suffix not in (".js", ".css"):
        return Response("not found", 404, headers=HEADERS, media_type="text/plain")
    return _file(name)


@router.get("/")
@router.get("/{page}")
def page(request: Request, page: str = "") -> Response:
    if page not in PAGES:
        return Response("not found", 404, headers=HEADERS, media_type="text/plain")
    if not _logged_in(request):
        return RedirectResponse(f"{PREFIX}/login", 303, headers=HEADERS)
    return _file(PAGES[page])


# --- what the pages show ----------------------------------------------------------------------


def _reading(last: dict[str, usage.Usage], service: Service) -> dict[str, Any]:
    """Every sandbox (with its usage when it runs: CPU share since ``last``'s reading of it), every snapshot, and
    the server's figures (``console_metrics``)."""
    rows = []
    seen = {}
    for sb in Sandbox.list():
        info = sb.info()
        row = info.to_wire() | {"parent_snapshot": sb.parent_snapshot, "cpu_pct": None, "mem_used": None,
                                "disk_used": None}
        now = usage.read(sb) if info.state == "running" else None
        if now is not None:
            before = last.get(sb.id)
            row.update(mem_used=now.mem_used, disk_used=now.disk_used,
                       cpu_pct=None if before is None else round(usage.cpu_share(before, now, info.limits.cpus), 1))
            seen[sb.id] = now
        rows.append(row)
    last.clear()
    last.update(seen)
    return {"now": time.time(), "sandboxes": rows, "snapshots": [s.info().to_wire() for s in Snapshot.list()],
            "server": console_metrics.sample(service)}


class Readings:
    """One reading shared by every open page: taken at most once a TICK however many streams ask (each costs a
    runc call per sandbox), off the event loop."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.history = console_metrics.History()  # the server's figures of the last readings
        self._last: dict[str, usage.Usage] = {}
        self._latest: tuple[float, dict[str, Any]] | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> dict[str, Any]:
        async with self._lock:
            if self._latest is None or time.monotonic() - self._latest[0] >= TICK * 0.9:
                self._latest = (time.monotonic(), await run_in_threadpool(_reading, self._last, self.service))
                self.history.add(self._latest[1]["server"])
            return self._latest[1]


@router.get("/api/state")
async def state(request: Request) -> Response:
    """The latest reading, as the event stream sends them (a CPU share is None until a second reading)."""
    if not _logged_in(request):
        return _unauthorized()
    return JSONResponse(await request.app.state.console_readings.get(), headers=HEADERS)


@router.get("/api/events")
async def events(request: Request) -> Response:
    """Server-sent events: a ``state`` event (what ``/api/state`` answers) every TICK seconds, for a while."""
    if not _logged_in(request):
        return _unauthorized()
    sessions = _sessions(request)
    if sessions.streams >= MAX_STREAMS:
        return JSONResponse({"error": "TooManyStreams", "message": f"{MAX_STREAMS} console streams are open",
                             "fix": "close other console tabs", "id": None}, 429, HEADERS)
    readings: Readings = request.app.state.console_readings

    async def stream() -> AsyncIterator[str]:
        sessions.streams += 1  # counted here, where the finally is sure to run
        ends = time.monotonic() + STREAM_SECONDS
        try:
            yield "retry: 1000\n\n"
            while time.monotonic() < ends and _logged_in(request):
                yield f"event: state\ndata: {json.dumps(await readings.get())}\n\n"
                await asyncio.sleep(TICK)  # the pace of the readings (nothing waits on it)
        finally:
            sessions.streams -= 1

    return StreamingResponse(stream(), media_type="text/event-stream", headers=HEADERS)


# --- actions ----------------------------------------------------------------------------------


Action = Literal["pause", "resume", "fork", "snapshot", "close"]


def _act(service: Service, action: Action, sandbox_id: str) -> Response:
    """The API's route function for ``action`` on the sandbox (the same checks, quotas and errors)."""
    if action == "pause":
        return snapshots.pause(service, sandbox_id)
    if action == "resume":
        return snapshots.resume(service, sandbox_id)
    if action == "fork":
        return snapshots.fork(service, sandbox_id, ForkRequest(count=2, memory=True))
    if action == "snapshot":
        return snapshots.snapshot(service, sandbox_id, SnapshotRequest(memory=True))
    return sandboxes.close_sandbox(service, sandbox_id)


@router.post("/api/sandboxes/{sandbox_id}/{action}")
async def act(request: Request, sandbox_id: SandboxId, action: Action) -> Response:
    """Pause, resume, fork (two children, memory and all), snapshot (memory and all) or close a sandbox."""
    if not _logged_in(request):
        return _unauthorized()
    origin = request.headers.get("origin")
    if request.headers.get(ACTION_HEADER) != "1" or (origin is not None and origin != _own_origin(request)):
        return JSONResponse({"error": "Forbidden", "message": "a console action must come from the console's page",
                             "fix": f"send {ACTION_HEADER}: 1 from the same origin", "id": None}, 403, HEADERS)
    try:
        reply = await run_in_threadpool(_act, request.app.state.service, action, sandbox_id)
    except Exception as e:  # noqa: BLE001 - mapped to the API's typed error body
        reply = error_response(e, request)
    reply.headers.update(HEADERS)
    return reply


def _own_origin(request: Request) -> str:
    return f"{request.url.scheme}://{request.headers.get('host', '')}"
