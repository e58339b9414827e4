"""envd's ``filesystem.Filesystem`` service and its ``/files`` and ``/health`` routes, over a sandbox's files.

Stat, list, make, move and remove are the agent's own file calls (``Sandbox.stat`` and friends), made as the
account the request names (``bridge.acting``): relative paths start at its home, and what is written is its own. Watching a
directory compares listings: a watcher keeps the last listing of its folder and reports what appeared
(create, and write for a non-empty file), changed (write, chmod) or went (remove) since; so it needs no
inotify descriptor in the sandbox, which CRIU could not carry through a pause or fork. Events between two
looks that cancel out (a file made and removed in between) are not seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_connect
from e2b.envd.filesystem import filesystem_pb as pb
from protobuf.wkt import Timestamp
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router

from agentenv import errors
from agentenv.api import FileInfo
from agentenv.sandbox.calls import Calls
from agentenv.server.e2b.bridge import acting, call, connect_error, one_of, run, sandbox_of, user_named
from agentenv.server.limits import MAX_UPLOAD
from agentenv.server.service import Service

HEALTH_PING_TIMEOUT = 5.0  # seconds /health waits for the agent's answer
MAX_WATCHERS = 1024  # watchers kept per server; the oldest goes first
WATCH_DEPTH = 16  # levels a recursive watch looks down
WATCH_POLL = 0.25  # seconds between looks of a streamed watch
Listing = dict[str, tuple[str, int, float, int]]  # path relative to the folder -> (type, size, mtime, mode)


def entry(info: FileInfo) -> pb.EntryInfo:
    seconds, frac = divmod(info.modified, 1.0)
    return pb.EntryInfo(
        name=info.name, path=info.path, size=info.size, mode=info.mode, permissions=info.permissions,
        owner=info.owner, group=info.group, type=pb.FileType.DIRECTORY if info.type == "dir" else pb.FileType.FILE,
        modified_time=Timestamp(seconds=int(seconds), nanos=int(frac * 1e9)), symlink_target=info.symlink_target,
        is_symlink=info.symlink_target is not None)


def listing(sb: Calls, path: str, recursive: bool) -> Listing:
    base = sb.stat(path).path.rstrip("/") + "/"
    return {f.path.removeprefix(base): (f.type, f.size, f.modified, f.mode)
            for f in sb.list_dir(path, depth=WATCH_DEPTH if recursive else 1)}


def changes(old: Listing, new: Listing) -> list[pb.FilesystemEvent]:
    """What happened between two listings, as envd's events."""
    out: list[pb.FilesystemEvent] = []
    for name, now in new.items():
        was = old.get(name)
        if was is None:
            out.append(pb.FilesystemEvent(name=name, type=pb.EventType.CREATE))
            if now[0] == "file" and now[1] > 0:
                out.append(pb.FilesystemEvent(name=name, type=pb.EventType.WRITE))
        elif was[:3] != now[:3] and now[0] == "file":
            out.append(pb.FilesystemEvent(name=name, type=pb.EventType.WRITE))
        elif was[3] != now[3]:
            out.append(pb.FilesystemEvent(name=name, type=pb.EventType.CHMOD))
    out += [pb.FilesystemEvent(name=name, type=pb.EventType.REMOVE) for name in old if name not in new]
    return out


class FilesystemService(filesystem_connect.Filesystem):
    """The envd filesystem service of every sandbox (the sandbox comes from the request's headers)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.watchers: OrderedDict[str, tuple[str, str, bool, Listing]] = OrderedDict()

    async def _calls(self, ctx: RequestContext[Any, Any]) -> Calls:
        """The request's sandbox, as the account the request names (``bridge.acting``)."""
        return await call(acting, await call(sandbox_of, self.service, ctx), user_named(ctx.request_headers))

    async def stat(self, request: pb.StatRequest, ctx: RequestContext[Any, Any]) -> pb.StatResponse:
        sb = await self._calls(ctx)
        return pb.StatResponse(entry=entry(await call(sb.stat, request.path, resolve_links=True)))

    async def make_dir(self, request: pb.MakeDirRequest, ctx: RequestContext[Any, Any]) -> pb.MakeDirResponse:
        sb = await self._calls(ctx)
        if not await call(sb.make_dir, request.path):
            raise ConnectError(Code.ALREADY_EXISTS, f"directory {request.path} already exists")
        return pb.MakeDirResponse(entry=entry(await call(sb.stat, request.path, resolve_links=True)))

    async def move(self, request: pb.MoveRequest, ctx: RequestContext[Any, Any]) -> pb.MoveResponse:
        sb = await self._calls(ctx)
        return pb.MoveResponse(entry=entry(await call(sb.move, request.source, request.destination)))

    async def list_dir(self, request: pb.ListDirRequest, ctx: RequestContext[Any, Any]) -> pb.ListDirResponse:
        sb = await self._calls(ctx)
        found = await call(sb.list_dir, request.path, depth=max(1, request.depth or 1), resolve_links=True)
        return pb.ListDirResponse(entries=[entry(f) for f in found])

    async def remove(self, request: pb.RemoveRequest, ctx: RequestContext[Any, Any]) -> pb.RemoveResponse:
        sb = await self._calls(ctx)
        await call(_remove, sb, request.path)
        return pb.RemoveResponse()

    async def _dir(self, sb: Calls, path: str, recursive: bool) -> Listing:
        info = await call(sb.stat, path)
        if info.type != "dir":
            raise ConnectError(Code.INVALID_ARGUMENT, f"{path} is not a directory")
        return await call(listing, sb, path, recursive)

    async def watch_dir(self, request: pb.WatchDirRequest,
                        ctx: RequestContext[Any, Any]) -> AsyncIterator[pb.WatchDirResponse]:
        sb = await self._calls(ctx)
        seen = await self._dir(sb, request.path, request.recursive)
        yield pb.WatchDirResponse(event=one_of("start", pb.WatchDirResponse.StartEvent()))
        quiet = time.monotonic()
        while True:
            await asyncio.sleep(WATCH_POLL)
            try:
                now = await call(listing, sb, request.path, request.recursive)
            except ConnectError as e:
                if e.code == Code.NOT_FOUND:  # the folder itself went
                    return
                raise
            events, seen = changes(seen, now), now
            for event in events:
                yield pb.WatchDirResponse(event=one_of("filesystem", event))
            if events or time.monotonic() - quiet > 5:
                quiet = time.monotonic()
                if not events:  # lets the server notice a client that left
                    yield pb.WatchDirResponse(event=one_of("keepalive", pb.WatchDirResponse.KeepAlive()))

    async def create_watcher(self, request: pb.CreateWatcherRequest,
                             ctx: RequestContext[Any, Any]) -> pb.CreateWatcherResponse:
        sb = await self._calls(ctx)
        seen = await self._dir(sb, request.path, request.recursive)
        watcher_id = uuid.uuid4().hex
        self.watchers[watcher_id] = (sb.id, request.path, request.recursive, seen)
        while len(self.watchers) > MAX_WATCHERS:
            self.watchers.popitem(last=False)
        return pb.CreateWatcherResponse(watcher_id=watcher_id)

    def _watcher(self, sb: Calls, watcher_id: str) -> tuple[str, str, bool, Listing]:
        """A watcher of this sandbox (another sandbox's watchers are not found from here)."""
        found = self.watchers.get(watcher_id)
        if found is None or found[0] != sb.id:
            raise ConnectError(Code.NOT_FOUND, f"watcher {watcher_id} not found")
        return found

    async def get_watcher_events(self, request: pb.GetWatcherEventsRequest,
                                 ctx: RequestContext[Any, Any]) -> pb.GetWatcherEventsResponse:
        sb = await self._calls(ctx)
        _, path, recursive, seen = self._watcher(sb, request.watcher_id)
        now = await call(listing, sb, path, recursive)
        self.watchers[request.watcher_id] = (sb.id, path, recursive, now)
        return pb.GetWatcherEventsResponse(events=changes(seen, now))

    async def remove_watcher(self, request: pb.RemoveWatcherRequest,
                             ctx: RequestContext[Any, Any]) -> pb.RemoveWatcherResponse:
        sb = await self._calls(ctx)
        self._watcher(sb, request.watcher_id)
        del self.watchers[request.watcher_id]
        return pb.RemoveWatcherResponse()


# --- /files and /health -------------------------------------------------------------------------

_FULL = (errno.ENOSPC, errno.EDQUOT)
_HTTP = {Code.UNAUTHENTICATED: 401, Code.NOT_FOUND: 404, Code.INVALID_ARGUMENT: 400, Code.PERMISSION_DENIED: 403, Code.ALREADY_EXISTS: 409,
         Code.UNAVAILABLE: 502, Code.RESOURCE_EXHAUSTED: 429, Code.FAILED_PRECONDITION: 400}


def _remove(sb: Calls, path: str) -> None:
    """``Sandbox.remove``, where removing what is not there is no error (as in envd)."""
    with contextlib.suppress(FileNotFoundError):
        sb.remove(path)


def http_error(exc: BaseException) -> JSONResponse:
    """envd's HTTP error body ``{code, message}``; the SDK maps 404 to FileNotFoundException, and so on."""
    err = connect_error(exc)
    # a full disk (ENOSPC) or disk limit (EDQUOT): an OSError, or (from an agent of a snapshot made before) a
    # SandboxError whose message carries the errno
    full = isinstance(exc, OSError) and exc.errno in _FULL or any(f"[Errno {n}]" in err.message for n in _FULL)
    status = 507 if full else _HTTP.get(err.code, 500)
    return JSONResponse({"code": status, "message": err.message}, status)


def files_routes(service: Service) -> Router:
    def sandbox(request: Request) -> Calls:
        """The request's sandbox, as the account ``?username=`` names (``bridge.acting``)."""
        return acting(service.sandbox(request.headers.get("e2b-sandbox-id", "")),
                      user_named(request.headers, request.query_params))

    async def health(request: Request) -> Response:
        """204 while the sandbox's agent runs, else the 502 ``was not found`` of E2B's proxy. Asked of runc and
        the agent, not the record: the SDK probes here when a stream breaks, and a kill under way still reads
        'running' in the record (and, for an instant, in runc: an exiting init is no zombie until the rest of
        its namespace is gone) after the agent's connections closed; this answer lets it say the sandbox was
        killed. An agent that is slow to answer is still running (a gone one is SandboxLost)."""
        sid = request.headers.get("e2b-sandbox-id", "")

        def state() -> str | None:
            with contextlib.suppress(errors.SandboxNotFound, ValueError):
                sb = service.sandbox(sid)
                now = sb.state
                if now == "running":
                    try:
                        sb.ping(timeout=HEALTH_PING_TIMEOUT)
                    except errors.SandboxStateError:  # its agent gone (SandboxLost), or closed meanwhile
                        return "lost"
                    except errors.AgentEnvError:
                        pass  # busy, not gone: the SDK is told it runs
                return now
            return None

        if await run(state) != "running":
            return JSONResponse({"code": 502, "message": f"The sandbox {sid} was not found", "sandboxId": sid}, 502)
        return Response(status_code=204)

    async def download(request: Request) -> Response:
        path = request.query_params.get("path", "")
        try:
            sb = await call(sandbox, request)
            data = await call(sb.read_file, path)
        except Exception as e:  # noqa: BLE001 - an error body the SDK maps
            return http_error(e)
        name = os.path.basename(path) or "file"
        return Response(data, media_type="application/octet-stream",
                        headers={"Content-Disposition": f'attachment; filename="{name}"'})

    async def upload(request: Request) -> Response:
        try:
            sb = await call(sandbox, request)
            written = []
            for path, data in await _uploads(request):
                await call(sb.write_file, path, data)
                info = await call(sb.stat, path)
                written.append({"name": info.name, "type": "file", "path": info.path})
        except Exception as e:  # noqa: BLE001 - an error body the SDK maps
            return http_error(e)
        return JSONResponse(written)

    return Router(routes=[Route("/health", health, methods=["GET"]), Route("/files", download, methods=["GET"]),
                          Route("/files", upload, methods=["POST"])])


async def _uploads(request: Request) -> list[tuple[str, bytes]]:
    """(path, bytes) of each file of an upload: octet-stream to ``?path=`` (gzip allowed), or multipart
    ``file`` fields named by their file names (one file may be named by ``?path=`` instead)."""
    path = request.query_params.get("path")
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "multipart/form-data":
        if not path:
            raise ValueError("an octet-stream upload needs ?path=")
        data = await request.body()
        if request.headers.get("content-encoding", "").lower() == "gzip":
            inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
            data = inflate.decompress(data, MAX_UPLOAD)
            if inflate.unconsumed_tail:
                raise ValueError(f"the upload inflates past {MAX_UPLOAD} bytes")
        return [(path, data)]
    form = await request.form(max_files=1000)
    files = [v for k, v in form.multi_items() if k == "file" and not isinstance(v, str)]
    if not files:
        raise ValueError("a multipart upload needs 'file' fields")
    out = []
    for f in files:
        name = path if path and len(files) == 1 else f.filename
        if not name:
            raise ValueError("each uploaded file needs a file name (its path in the sandbox)")
        out.append((name, await f.read()))
    return out
