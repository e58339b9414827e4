"""The console's sandbox page (``/console/sandbox/<id>``: its processes and jobs, a tail of a job's output, a
read-only file browser) and what the server page draws (``/console/api/server``: the history of its figures).

Every read goes through the server's ``Service`` with the calls the API's routes make (``Sandbox.processes``,
``jobs``, ``list_dir``, ``stat``, ``read_file``), so the same path rules hold (the keeper's own folders answer 403
here as there). A job's tail is ``Sandbox.tail``: a look that leaves the output and the job's end for its owner's
``output``. What is shown is capped (TAIL_BYTES, MAX_ENTRIES, MAX_FILE), and the page says so. Sandbox-made text
(file names, output, commands) goes out as JSON strings that the page sets as text only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, RedirectResponse

from agentenv.sandbox.core import Sandbox
from agentenv.server.console_auth import HEADERS, PREFIX, console_page, logged_in, unauthorized
from agentenv.server.routing import error_response
from agentenv.server.schemas import FilePath, Pid, SandboxId
from agentenv.server.service import Service

TAIL_BYTES = 16 << 10  # the last bytes of each stream of a job shown
MAX_ENTRIES = 500  # entries of one folder shown
MAX_FILE = 256 << 10  # bytes of a file shown (a bigger one is not read: download it with the API)

router = APIRouter(prefix=PREFIX, include_in_schema=False)


@router.get("/sandbox/{sandbox_id}")
def sandbox_page(request: Request, sandbox_id: SandboxId) -> Response:
    if not logged_in(request):
        return RedirectResponse(f"{PREFIX}/login", 303, headers=HEADERS)
    return console_page(request, "sandbox.html")


async def _serve(request: Request, fn: Callable[[Service], Any]) -> Response:
    """``fn``'s answer as JSON, or the API's typed error for what it raised (a 401 when not logged in)."""
    if not logged_in(request):
        return unauthorized()
    try:
        reply: Response = JSONResponse(await run_in_threadpool(fn, request.app.state.service))
    except Exception as e:  # noqa: BLE001 - mapped to the API's typed error body
        reply = error_response(e, request)
    reply.headers.update(HEADERS)
    return reply


@router.get("/api/server")
async def server_history(request: Request) -> Response:
    """The server's figures of the last readings (oldest first); the event stream brings the next ones."""
    return await _serve(request, lambda _: {"history": request.app.state.console_readings.history.items()})


def _detail(service: Service, sandbox_id: str) -> dict[str, Any]:
    sb = service.sandbox(sandbox_id)
    info = sb.info()
    found: dict[str, Any] = {"sandbox": info.to_wire(), "processes": [], "jobs": [],
                             "caps": {"tail_bytes": TAIL_BYTES, "max_entries": MAX_ENTRIES, "max_file": MAX_FILE}}
    if info.state == "running":  # a paused sandbox has no processes to ask (resume it first)
        found["processes"] = service.call(sandbox_id, lambda s: [p.info().to_wire() for p in s.processes()])
        found["jobs"] = service.call(sandbox_id, lambda s: [j.to_wire() for j in s.jobs()])
    return found


@router.get("/api/sandboxes/{sandbox_id}")
async def detail(request: Request, sandbox_id: SandboxId) -> Response:
    """The sandbox, its processes (``spawn``'s) and its jobs (``start``'s) when it runs."""
    return await _serve(request, lambda service: _detail(service, sandbox_id))


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _tail(service: Service, sandbox_id: str, pid: int) -> dict[str, Any]:
    pieces = service.call(sandbox_id, lambda sb: sb.tail(pid, TAIL_BYTES))
    return {"pid": pid, "tail_bytes": TAIL_BYTES,
            "output": [{"stream": p.stream, "offset": p.offset, "text": _text(p.data)} for p in pieces]}


@router.get("/api/sandboxes/{sandbox_id}/jobs/{pid}/tail")
async def tail(request: Request, sandbox_id: SandboxId, pid: Pid) -> Response:
    """The last TAIL_BYTES of each stream of a job, left for its owner to read (``Sandbox.tail``)."""
    return await _serve(request, lambda service: _tail(service, sandbox_id, pid))


def _listing(service: Service, sandbox_id: str, path: str) -> dict[str, Any]:
    entries = service.call(sandbox_id, lambda sb: sb.list_dir(path, 1))
    entries.sort(key=lambda f: (f.type != "dir", f.name))
    return {"path": path, "total": len(entries), "max_entries": MAX_ENTRIES,
            "entries": [f.to_wire() for f in entries[:MAX_ENTRIES]]}


@router.get("/api/sandboxes/{sandbox_id}/list")
async def list_dir(request: Request, sandbox_id: SandboxId, path: FilePath) -> Response:
    """A folder's entries (folders first, at most MAX_ENTRIES), with the API's path rules."""
    return await _serve(request, lambda service: _listing(service, sandbox_id, path))


def _read(service: Service, sandbox_id: str, path: str) -> dict[str, Any]:
    def run(sb: Sandbox) -> dict[str, Any]:
        info = sb.stat(path)
        if info.type == "dir":
            raise IsADirectoryError(21, f"{path} is a folder: list it instead")
        found: dict[str, Any] = {"path": info.path, "size": info.size, "max_file": MAX_FILE, "text": None}
        if info.size <= MAX_FILE:  # (a /proc file says 0: read_file caps it, and so does the slice)
            data = sb.read_file(path)
            found.update(text=_text(data[:MAX_FILE]), truncated=len(data) > MAX_FILE)
        return found
    result: dict[str, Any] = service.call(sandbox_id, run)
    return result


@router.get("/api/sandboxes/{sandbox_id}/file")
async def read_file(request: Request, sandbox_id: SandboxId, path: FilePath) -> Response:
    """A file's text (undecodable bytes replaced), when it is at most MAX_FILE bytes; its size either way."""
    return await _serve(request, lambda service: _read(service, sandbox_id, path))
