"""The web console under ``/console``: the sandboxes (state, CPU, memory, disk, live over server-sent events), the
snapshots' fork tree, buttons that pause, resume, fork, snapshot and close a sandbox, and buttons that restore and
delete a snapshot; a sandbox's own page and the server's figures are ``console_sandbox``'s and ``console_metrics``'.

Behind the server's token: the login page (``console_auth``) takes it and sets a cookie holding a random session
id (never the token), scoped to ``/console`` (HttpOnly, SameSite=Strict). The cookie opens the console only: the API routes
check the bearer header alone, so no page elsewhere can ride the cookie into them. The console's actions call the
API's own route functions (``routes/sandboxes.py``, ``routes/snapshots.py``), so they pass the same checks and
quotas; they also need a header that a cross-site form cannot send, and the console's own origin
(``console_auth.same_origin``: scheme, host and port, since another port of the host is the same site).
Sandbox-made text (labels, image names) only ever reaches the page as text (``textContent``), under a CSP that
allows this server's own scripts alone.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, RedirectResponse, StreamingResponse

from agentenv.sandbox import usage
from agentenv.sandbox.core import Sandbox
from agentenv.server import console_metrics, console_sandbox
from agentenv.server.console_auth import (
    HEADERS,
    PREFIX,
    console_page,
    forbidden,
    logged_in,
    same_origin,
    serve_login,
    sessions,
    unauthorized,
)
from agentenv.server.routes import sandboxes, snapshots
from agentenv.server.routing import error_response
from agentenv.server.schemas import ForkRequest, RestoreRequest, SandboxId, SnapshotId, SnapshotRequest
from agentenv.server.service import Service
from agentenv.snapshot.store import Snapshot

TICK = 1.0  # seconds between two readings on an event stream
STREAM_SECONDS = 15.0  # an event stream ends after this long (the browser reconnects), so none holds a shutdown up
MAX_STREAMS = 16  # event streams open at once
ACTION_HEADER = "x-agentenv-console"
PAGES = {"": "sandboxes.html", "snapshots": "snapshots.html", "server": "server.html"}

router = APIRouter(prefix=PREFIX, include_in_schema=False)


def install(app: Any) -> None:
    """Serve the console on ``app`` (made by ``create_app``, whose state holds the token and the service)."""
    serve_login(app)
    app.state.console_links = [(f"{PREFIX}/", "Sandboxes"), (f"{PREFIX}/snapshots", "Snapshots"),
                               (f"{PREFIX}/server", "Server"), *getattr(app.state, "console_links", ())]
    app.state.console_readings = Readings(app.state.service)
    app.include_router(router)
    app.include_router(console_sandbox.router)


@router.get("/")
@router.get("/{page}")
def page(request: Request, page: str = "") -> Response:
    if page not in PAGES:
        return Response("not found", 404, headers=HEADERS, media_type="text/plain")
    if not logged_in(request):
        return RedirectResponse(f"{PREFIX}/login", 303, headers=HEADERS)
    return console_page(request, PAGES[page])


# --- what the pages show ----------------------------------------------------------------------


def _reading(last: dict[str, usage.Usage], service: Service) -> dict[str, Any]:
    """Every sandbox (with its usage when it runs: CPU share since ``last``'s reading of it), every snapshot, and
    the server's figures (``console_metrics``)."""
    rows = []
    seen = {}
    for sb in Sandbox.list():
        info = sb.info()
        row = info.to_wire() | {"cpu_pct": None, "mem_used": None, "disk_used": None}
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
    if not logged_in(request):
        return unauthorized()
    return JSONResponse(await request.app.state.console_readings.get(), headers=HEADERS)


@router.get("/api/events")
async def events(request: Request) -> Response:
    """Server-sent events: a ``state`` event (what ``/api/state`` answers) every TICK seconds, for a while."""
    if not logged_in(request):
        return unauthorized()
    open_ = sessions(request)
    if open_.streams >= MAX_STREAMS:
        return JSONResponse({"error": "TooManyStreams", "message": f"{MAX_STREAMS} console streams are open",
                             "fix": "close other console tabs", "id": None}, 429, HEADERS)
    readings: Readings = request.app.state.console_readings

    async def stream() -> AsyncIterator[str]:
        open_.streams += 1  # counted here, where the finally is sure to run
        ends = time.monotonic() + STREAM_SECONDS
        try:
            yield "retry: 1000\n\n"
            while time.monotonic() < ends and logged_in(request):
                yield f"event: state\ndata: {json.dumps(await readings.get())}\n\n"
                await asyncio.sleep(TICK)  # the pace of the readings (nothing waits on it)
        finally:
            open_.streams -= 1

    return StreamingResponse(stream(), media_type="text/event-stream", headers=HEADERS)


# --- actions ----------------------------------------------------------------------------------


Action = Literal["pause", "resume", "fork", "snapshot", "close"]
SnapshotAction = Literal["restore", "delete"]


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


def _act_on_snapshot(service: Service, action: SnapshotAction, snapshot_id: str) -> Response:
    """The API's route function for ``action`` on the snapshot: a new sandbox from it (no labels), or its deletion."""
    if action == "restore":
        return snapshots.restore(service, snapshot_id, RestoreRequest())
    return snapshots.delete_snapshot(snapshot_id)


async def _action(request: Request, run: Callable[[Service], Response]) -> Response:
    """``run``'s reply for a logged-in console page of this origin with the action header; the API's typed error
    for what it raised."""
    if not logged_in(request):
        return unauthorized()
    if request.headers.get(ACTION_HEADER) != "1" or not same_origin(request):
        return forbidden(f"a console action (with {ACTION_HEADER}: 1)")
    try:
        reply = await run_in_threadpool(run, request.app.state.service)
    except Exception as e:  # noqa: BLE001 - mapped to the API's typed error body
        reply = error_response(e, request)
    reply.headers.update(HEADERS)
    return reply


@router.post("/api/sandboxes/{sandbox_id}/{action}")
async def act(request: Request, sandbox_id: SandboxId, action: Action) -> Response:
    """Pause, resume, fork (two children, memory and all), snapshot (memory and all) or close a sandbox."""
    return await _action(request, lambda service: _act(service, action, sandbox_id))


@router.post("/api/snapshots/{snapshot_id}/{action}")
async def act_on_snapshot(request: Request, snapshot_id: SnapshotId, action: SnapshotAction) -> Response:
    """Restore a snapshot into a new sandbox, or delete it (the page asks first)."""
    return await _action(request, lambda service: _act_on_snapshot(service, action, snapshot_id))
