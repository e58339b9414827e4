"""envd's ``filesystem.Filesystem`` service and its ``/files`` and ``/health`` routes, over a sandbox's files.

Stat, list, make, move and remove are the keeper's own file calls (``Sandbox.stat`` and friends), made as the
account the request names (``bridge.acting``): relative paths start at its home, and what is written is its own. Watching a
directory compares listings: a watcher keeps the last listing of its folder and reports what appeared
(create, and write for a non-empty file), changed (write, chmod) or went (remove) since; so it needs no
inotify descriptor in the sandbox, which CRIU could not carry through a pause or fork. Events between two
looks that cancel out (a file made and removed in between) are not seen. A file ``/files`` wrote gets envd's
CHMOD too (``Uploads``). An upload's ``X-Metadata-*`` headers become the file's ``user.e2b.*`` xattrs, set by
the keeper inside the sandbox as the account (``agentenv.inside.files.write_metadata``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import os
import time
import uuid
import zlib
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
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
from agentenv.server.e2b.signed import SCOPE_KEY
from agentenv.server.limits import MAX_UPLOAD
from agentenv.server.service import Service

HEALTH_PING_TIMEOUT = 5.0  # seconds /health waits for the keeper's answer
MAX_WATCHERS = 1024  # watchers kept per server; past it, the oldest of the sandbox that holds the most goes
MAX_SANDBOX_WATCHERS = 64  # watchers one sandbox may hold: one more is refused, so no sandbox pushes out another's
MAX_UPLOADS = 4096  # files written through /files remembered for the watchers (``Uploads``)
WATCH_DEPTH = 16  # levels a recursive watch looks down
WATCH_POLL = 0.25  # seconds between looks of a streamed watch
DIR_BLOCK = 4096  # a folder's size is given in whole blocks of this, as ext4 (envd's file system) reports it
Listing = dict[str, FileInfo]  # path relative to the folder -> what is there


def entry(info: FileInfo) -> pb.EntryInfo:
    """envd's EntryInfo of a file. As envd, ``type`` is a symlink's target's and ``is_symlink`` is left unset
    (the SDK would then say SYMLINK where envd's callers see the target's type); a folder's size is in whole
    ``DIR_BLOCK`` blocks, at least one, as on envd's ext4 (btrfs and overlay give 0 for an empty one)."""
    seconds, frac = divmod(info.modified, 1.0)
    size = -(-max(info.size, 1) // DIR_BLOCK) * DIR_BLOCK if info.type == "dir" else info.size
    return pb.EntryInfo(
        name=info.name, path=info.path, size=size, mode=info.mode, permissions=info.permissions,
        owner=info.owner, group=info.group, type=pb.FileType.DIRECTORY if info.type == "dir" else pb.FileType.FILE,
        modified_time=Timestamp(seconds=int(seconds), nanos=int(frac * 1e9)), symlink_target=info.symlink_target,
        metadata=dict(info.metadata or {}))


def listing(sb: Calls, path: str, recursive: bool) -> Listing:
    base = sb.stat(path).path.rstrip("/") + "/"
    return {f.path.removeprefix(base): f
            for f in sb.list_dir(path, depth=WATCH_DEPTH if recursive else 1, resolve_links=True)}


class Uploads:
    """The files this server last wrote through ``/files`` (sandbox id and path -> mtime), so that a watcher
    reports them as envd reports its own uploads: envd chowns the file it writes to the account (a CHMOD
    event between the CREATE and the WRITE), which a file written by a command in the sandbox does not get."""

    def __init__(self) -> None:
        self.written: OrderedDict[tuple[str, str], float] = OrderedDict()

    def add(self, sandbox_id: str, info: FileInfo) -> None:
        self.written.pop((sandbox_id, info.path), None)
        self.written[(sandbox_id, info.path)] = info.modified
        while len(self.written) > MAX_UPLOADS:
            self.written.popitem(last=False)

    def made(self, sandbox_id: str, info: FileInfo) -> bool:
        """Whether ``info`` is the file as an upload left it (not changed since)."""
        return self.written.get((sandbox_id, info.path)) == info.modified


def _state(info: FileInfo) -> tuple[str, int, float]:
    return info.type, info.size, info.modified


def changes(old: Listing, new: Listing, uploaded: Callable[[FileInfo], bool] = lambda _: False,
            with_entry: bool = False) -> list[pb.FilesystemEvent]:
    """What happened between two listings, as envd's events (``uploaded``: whether a file is one ``/files``
    wrote, see ``Uploads``; ``with_entry``: CREATE, WRITE and CHMOD carry the entry, as envd's include_entry)."""
    out: list[pb.FilesystemEvent] = []

    def add(name: str, kind: pb.EventType, info: FileInfo | None = None) -> None:
        event = pb.FilesystemEvent(name=name, type=kind)
        if with_entry and info is not None:
            event.entry = entry(info)
        out.append(event)

    for name, now in new.items():
        was = old.get(name)
        by_upload = now.type == "file" and uploaded(now)
        if was is None:
            add(name, pb.EventType.CREATE, now)
            if by_upload:
                add(name, pb.EventType.CHMOD, now)
            if now.type == "file" and now.size > 0:
                add(name, pb.EventType.WRITE, now)
        elif _state(was) != _state(now) and now.type == "file":
            if by_upload:
                add(name, pb.EventType.CHMOD, now)
            add(name, pb.EventType.WRITE, now)
        elif was.mode != now.mode or (was.metadata or {}) != (now.metadata or {}):  # xattrs: inotify's ATTRIB too
            add(name, pb.EventType.CHMOD, now)
    for name in old:
        if name not in new:
            add(name, pb.EventType.REMOVE)
    return out


@dataclasses.dataclass
class Watcher:
    """A watcher made by CreateWatcher: its sandbox and folder, and the listing it last reported from."""

    sandbox_id: str
    path: str
    recursive: bool
    with_entry: bool
    seen: Listing


class FilesystemService(filesystem_connect.Filesystem):
    """The envd filesystem service of every sandbox (the sandbox comes from the request's headers)."""

    def __init__(self, service: Service, uploads: Uploads) -> None:
        self.service, self.uploads = service, uploads
        self.watchers: OrderedDict[str, Watcher] = OrderedDict()

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
            events = changes(seen, now, functools.partial(self.uploads.made, sb.id), request.include_entry)
            seen = now
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
        held = Counter(w.sandbox_id for w in self.watchers.values())
        if held[sb.id] >= MAX_SANDBOX_WATCHERS:
            raise ConnectError(Code.RESOURCE_EXHAUSTED, f"sandbox {sb.id} holds {MAX_SANDBOX_WATCHERS} watchers, "
                                                        "the most one sandbox may: stop some, then retry")
        watcher_id = uuid.uuid4().hex
        self.watchers[watcher_id] = Watcher(sb.id, request.path, request.recursive, request.include_entry, seen)
        held[sb.id] += 1
        while len(self.watchers) > MAX_WATCHERS:  # many sandboxes at their share: the biggest holder gives one up
            top = max(held, key=held.__getitem__)
            del self.watchers[next(k for k, w in self.watchers.items() if w.sandbox_id == top)]
            held[top] -= 1
        return pb.CreateWatcherResponse(watcher_id=watcher_id)

    def _watcher(self, sb: Calls, watcher_id: str) -> Watcher:
        """A watcher of this sandbox (another sandbox's watchers are not found from here)."""
        found = self.watchers.get(watcher_id)
        if found is None or found.sandbox_id != sb.id:
            raise ConnectError(Code.NOT_FOUND, f"watcher {watcher_id} not found")
        return found

    async def get_watcher_events(self, request: pb.GetWatcherEventsRequest,
                                 ctx: RequestContext[Any, Any]) -> pb.GetWatcherEventsResponse:
        sb = await self._calls(ctx)
        watcher = self._watcher(sb, request.watcher_id)
        now = await call(listing, sb, watcher.path, watcher.recursive)
        seen, watcher.seen = watcher.seen, now
        return pb.GetWatcherEventsResponse(
            events=changes(seen, now, functools.partial(self.uploads.made, sb.id), watcher.with_entry))

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
    # a full disk (ENOSPC) or disk limit (EDQUOT): an OSError, or (from a keeper of a snapshot made before) a
    # SandboxError whose message carries the errno
    full = isinstance(exc, OSError) and exc.errno in _FULL or any(f"[Errno {n}]" in err.message for n in _FULL)
    status = 507 if full else _HTTP.get(err.code, 500)
    return JSONResponse({"code": status, "message": err.message}, status)


META_HEADER = "x-metadata-"  # an upload's ``X-Metadata-<key>: <value>`` headers: the files' metadata
MAX_META_KEY = 255 - len("user.e2b.")  # an xattr name is at most 255 bytes
MAX_META_TOTAL = 4096  # bytes of names and values of one file's metadata, as envd allows


def upload_metadata(request: Request) -> dict[str, str]:
    """The metadata an upload's ``X-Metadata-*`` headers give (keys lowercased, as envd); a ValueError (400)
    names what envd would refuse: an empty or over-long key, a byte that is not printable ASCII, too much."""
    found: dict[str, str] = {}
    for raw_name, raw_value in request.headers.raw:
        name = raw_name.decode("latin-1").lower()
        if not name.startswith(META_HEADER):
            continue
        key, value = name[len(META_HEADER):], raw_value.decode("latin-1")
        if not key or len(key) > MAX_META_KEY:
            raise ValueError(f"invalid metadata: a key must be 1 to {MAX_META_KEY} bytes, got {len(key)}")
        for label, text in (("key", key), (f"value for key {key!r}", value)):
            if bad := next((c for c in text if not " " <= c <= "~"), None):
                raise ValueError(f"invalid metadata: the {label} holds {bad!r}, not printable ASCII")
        found.setdefault(key, value)
    if (total := sum(len("user.e2b.") + len(k) + len(v) for k, v in found.items())) > MAX_META_TOTAL:
        raise ValueError(f"invalid metadata: {total} bytes in all, over {MAX_META_TOTAL}")
    return found


def files_routes(service: Service, uploads: Uploads) -> Router:
    def sandbox(request: Request) -> Calls:
        """The request's sandbox, as the account ``?username=`` names (``bridge.acting``)."""
        return acting(service.sandbox(request.headers.get("e2b-sandbox-id", "")),
                      user_named(request.headers, request.query_params))

    async def health(request: Request) -> Response:
        """204 while the sandbox's keeper runs, else the 502 ``was not found`` of E2B's proxy. Asked of runc and
        the keeper, not the record: the SDK probes here when a stream breaks, and a kill under way still reads
        'running' in the record (and, for an instant, in runc: an exiting init is no zombie until the rest of
        its namespace is gone) after the keeper's connections closed; this answer lets it say the sandbox was
        killed. A keeper that is slow to answer is still running (a gone one is SandboxLost)."""
        sid = request.headers.get("e2b-sandbox-id", "")

        def state() -> str | None:
            with contextlib.suppress(errors.SandboxNotFound, ValueError):
                sb = service.sandbox(sid)
                now = sb.state
                if now == "running":
                    try:
                        sb.ping(timeout=HEALTH_PING_TIMEOUT)
                    except errors.SandboxStateError:  # its keeper gone (SandboxLost), or closed meanwhile
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
            metadata = upload_metadata(request)
            sb = await call(sandbox, request)
            written = []
            for path, data in await _uploads(request):
                await call(functools.partial(sb.write_file, path, data, metadata=metadata))
                info = await call(sb.stat, path)
                if (info.metadata or {}) != metadata:  # a keeper from before metadata, say: never dropped silently
                    raise ValueError(f"the metadata of {info.path} was not stored (the sandbox's keeper or file "
                                     "system does not keep it)")
                uploads.add(sb.id, info)
                written.append({"name": info.name, "type": "file", "path": info.path,
                                **({"metadata": info.metadata} if info.metadata else {})})
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
    if request.scope.get(SCOPE_KEY) and not (path and len(files) == 1):
        raise ValueError(f"a signed upload writes the one path it was signed for ({(path or '')[:256]!r}), as one "
                         f"'file' field: this one has {len(files)}" + ("" if path else " and the signature names no path"))
    out = []
    for f in files:
        name = path if path and len(files) == 1 else f.filename
        if not name:
            raise ValueError("each uploaded file needs a file name (its path in the sandbox)")
        out.append((name, await f.read()))
    return out
