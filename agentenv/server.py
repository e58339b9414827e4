"""The environment server: every operation of the sandbox API over HTTP (FastAPI), msgpack or JSON bodies.

``agentenv serve`` runs one per host. Every route but ``/health`` and ``/metrics`` needs
``Authorization: Bearer <token>`` (compared in constant time); the server refuses to start without a
token and binds 127.0.0.1 unless told otherwise. Errors are typed: each ``AgentEnvError`` maps to an
HTTP status and a body ``{error, message, fix, id}`` that the client turns back into the same class.

All state lives on disk (sandbox records and the snapshot store), so a server killed with ``kill -9``
and started again lists every paused sandbox and snapshot, reattaches to the running sandboxes and
reports the ones whose processes died as ``lost``. A background thread pauses sandboxes past their
TTL (``Sandbox.reap_expired``); quotas on live sandboxes and memory answer 429 with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import logging
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import Body, FastAPI, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from fastapi.routing import APIRoute
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    WithJsonSchema,
    field_validator,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from agentenv import __version__, errors, store, wire
from agentenv.config import parse_size
from agentenv.sandbox import MAX_FORK, Process, Sandbox
from agentenv.store import Snapshot

log = logging.getLogger("agentenv.server")

DEFAULT_PORT = 8700
TOKEN_ENV = "AGENTENV_TOKEN"
OPEN_PATHS = frozenset({"/health", "/metrics"})
MAX_UPLOAD = 1 << 30
RETRY_AFTER = 5.0

# --- request and response models (they are the OpenAPI contract) ------------------------------------

_NO_NUL = r"^[^\x00]*$"
_MIN_MEMORY = 32 << 20
_MEMORY = (r"^(?:(?:3[2-9]|[4-9][0-9]|[1-9][0-9]{2,6})[mM]|[1-9][0-9]{0,3}(?:\.[0-9]{1,3})?[gG])(?:[iI]?[bB])?$")
_WORKDIR = r"^/(?:[A-Za-z0-9_][A-Za-z0-9._-]{0,63}(?:/[A-Za-z0-9_][A-Za-z0-9._-]{0,63}){0,15})?$"
_SPECIAL = r"^/(?:proc|sys|dev)(?:/|$)"
def _number(v: Any) -> Any:
    """Numbers are numbers: no "1" for 1 and no true for 1 (JSON Schema's integer does allow 3.0)."""
    if isinstance(v, str | bool | bytes):
        raise ValueError("expected a number")
    return v


Int = Annotated[int, BeforeValidator(_number)]
Float = Annotated[float, BeforeValidator(_number)]
Text = Annotated[str, Field(pattern=_NO_NUL, max_length=1 << 20)]
Name = Annotated[str, Field(pattern=_NO_NUL, max_length=4096)]


def _map_schema(key_pattern: str, value_max: int) -> dict[str, Any]:
    """The OpenAPI schema of a str -> str mapping that constrains every key (pydantic says patternProperties)."""
    return {"type": "object", "maxProperties": 256,
            "propertyNames": {"type": "string", "pattern": key_pattern, "maxLength": 256},
            "additionalProperties": {"type": "string", "pattern": _NO_NUL, "maxLength": value_max}}


def _not_special(path: str | None) -> str | None:
    if path is not None and re.match(_SPECIAL, path):
        raise ValueError("workdir cannot be under /proc, /sys or /dev")
    return path


_LABEL_KEY = r"^[^\x00]+$"
_ENV_KEY = r"^[A-Za-z_][A-Za-z0-9_]*$"
Labels = Annotated[dict[Annotated[str, Field(pattern=_LABEL_KEY, max_length=256)],
                        Annotated[str, Field(pattern=_NO_NUL, max_length=4096)]],
                   Field(max_length=256), WithJsonSchema(_map_schema(_LABEL_KEY, 4096))]
Env = Annotated[dict[Annotated[str, Field(pattern=_ENV_KEY, max_length=256)],
                     Annotated[str, Field(pattern=_NO_NUL, max_length=1 << 16)]],
                Field(max_length=256), WithJsonSchema(_map_schema(_ENV_KEY, 1 << 16))]
Workdir = Annotated[Annotated[str, Field(pattern=_WORKDIR)] | None, AfterValidator(_not_special), WithJsonSchema({
    "anyOf": [{"type": "string", "pattern": _WORKDIR, "not": {"pattern": _SPECIAL}}, {"type": "null"}],
    "description": "absolute working directory (not under /proc, /sys or /dev)"})]
Memory = Annotated[str | Int, WithJsonSchema({
    "anyOf": [{"type": "string", "pattern": _MEMORY}, {"type": "integer", "minimum": _MIN_MEMORY, "maximum": 1 << 50}],
    "description": "'<n>m' (n >= 32), '<n>g', or bytes (>= 32 MiB)"})]
SandboxId = Annotated[str, PathParam(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", description="sandbox id")]
SnapshotId = Annotated[str, PathParam(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", description="snapshot id")]
FilePath = Annotated[str, Query(min_length=1, max_length=4096, pattern=r"^[^\x00]+$",
                                description="absolute, or relative to the sandbox's working directory; "
                                            "resolved inside the sandbox")]
State = Literal["creating", "running", "paused", "closed", "lost"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateRequest(_Body):
    image: str = Field("agentenv/base", pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}$")
    cpus: Float = Field(1.0, ge=0.01, le=64)
    memory: Memory = "1g"
    pids: Int = Field(512, ge=8, le=1 << 22)
    network: StrictBool = False
    env: Env = Field(default_factory=dict)
    workdir: Workdir = None
    ttl: Annotated[float, Field(ge=1e-3, le=1e7, strict=True)] | None = None
    labels: Labels = Field(default_factory=dict)

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: str | int) -> str | int:
        if isinstance(v, bool) or (isinstance(v, int) and not _MIN_MEMORY <= v <= 1 << 50) or \
                (isinstance(v, str) and not re.match(_MEMORY, v)):
            raise ValueError("memory must be '<n>m' (n >= 32), '<n>g', or a byte count >= 32 MiB")
        return v


class ExecRequest(_Body):
    command: Text
    timeout: Annotated[float, Field(ge=1e-3, le=1e6, strict=True)] | None = 600.0
    cwd: Name | None = None
    env: Env = Field(default_factory=dict)


class SpawnRequest(_Body):
    command: Text
    cwd: Name | None = None
    env: Env = Field(default_factory=dict)


class SnapshotRequest(_Body):
    memory: StrictBool = False
    labels: Labels = Field(default_factory=dict)


class ForkRequest(_Body):
    count: Int = Field(1, ge=1, le=MAX_FORK)
    memory: StrictBool = True  # False: the children get the files only, with fresh processes


class TTLRequest(_Body):
    ttl: Float = Field(ge=1e-3, le=1e7)


class RestoreRequest(_Body):
    labels: Labels = Field(default_factory=dict)


class KillRequest(_Body):
    signal: Int = Field(9, ge=1, le=64)


class LimitsInfo(BaseModel):
    cpus: float
    memory: int
    pids: int


class SandboxInfo(BaseModel):
    id: str
    state: State
    image: str
    created_at: float
    expires_at: float | None
    labels: dict[str, str]
    limits: LimitsInfo


class SnapshotInfo(BaseModel):
    id: str
    parent_id: str | None
    created_at: float
    size_bytes: int
    has_memory: bool
    sandbox_id: str | None
    labels: dict[str, str]


class ExecResultInfo(BaseModel):
    exit_code: int
    stdout: str
    stderr: str
    duration: float
    timed_out: bool


class ProcessInfo(BaseModel):
    pid: int
    log: str
    command: str
    exit_code: int | None


class FileWritten(BaseModel):
    path: str
    size: int


class Deleted(BaseModel):
    id: str
    state: Literal["closed", "deleted"]


class Capacity(BaseModel):
    max_sandboxes: int
    live_sandboxes: int
    free_sandboxes: int
    max_memory: int
    memory_used: int
    free_memory: int


class ServerInfo(BaseModel):
    version: str
    capacity: Capacity
    recovered: dict[str, list[str]] = Field(description="what the server found on disk when it started: "
                                                        "running (reattached), paused, lost")


class ErrorBody(BaseModel):
    error: str = Field(description="the exception class, e.g. SandboxNotFound")
    message: str
    fix: str | None = None
    id: str | None = Field(None, description="the sandbox or snapshot id the error is about")
    retry_after: float | None = None


# --- errors -----------------------------------------------------------------------------------------

_STATUS: list[tuple[type[BaseException], int]] = [
    (errors.Unauthorized, 401),
    (errors.SandboxNotFound, 404), (errors.SnapshotNotFound, 404), (errors.ImageNotFound, 404),
    (errors.SandboxStateError, 409),
    (errors.QuotaExceeded, 429),
    (errors.StoreFullError, 507),
    (errors.ConnectionLost, 502),
    (errors.AgentEnvError, 500),
    (FileNotFoundError, 404), (ProcessLookupError, 404), (PermissionError, 403),
    (IsADirectoryError, 409), (NotADirectoryError, 409), (FileExistsError, 409),
    (ValueError, 400), (TypeError, 400),
]


def status_of(exc: BaseException) -> int | None:
    """The HTTP status an exception maps to, or None when it is a bug (then 500)."""
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return code
    return None


def error_body(exc: BaseException, subject: str | None = None) -> dict[str, Any]:
    """The wire form of an exception; the client rebuilds the same class from ``error``."""
    fix = getattr(exc, "fix", None)
    message = str(exc)
    if fix and message.endswith(f" — {fix}"):
        message = message[: -len(fix) - 3]
    body: dict[str, Any] = {"error": type(exc).__name__, "message": message, "fix": fix, "id": subject}
    if isinstance(exc, errors.QuotaExceeded):
        body["retry_after"] = exc.retry_after
    if isinstance(exc, OSError) and not isinstance(exc, errors.AgentEnvError):
        body["message"] = exc.strerror or str(exc)
    return body


# --- the service: sandbox cache, quotas, metrics ------------------------------------------------------

@dataclass
class Metrics:
    """Operation latencies for Prometheus: a histogram per route."""

    buckets: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
    ops: dict[str, list[float]] = field(default_factory=dict)  # name -> [count, sum, *bucket counts]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, op: str, seconds: float) -> None:
        with self.lock:
            row = self.ops.setdefault(op, [0.0] * (2 + len(self.buckets)))
            row[0] += 1
            row[1] += seconds
            for i, b in enumerate(self.buckets):
                if seconds <= b:
                    row[2 + i] += 1

    def lines(self) -> Iterator[str]:
        yield "# HELP agentenv_operation_seconds Latency of server operations."
        yield "# TYPE agentenv_operation_seconds histogram"
        with self.lock:
            rows = {k: list(v) for k, v in self.ops.items()}
        for op, row in sorted(rows.items()):
            for i, b in enumerate(self.buckets):
                yield f'agentenv_operation_seconds_bucket{{op="{op}",le="{b}"}} {int(row[2 + i])}'
            yield f'agentenv_operation_seconds_bucket{{op="{op}",le="+Inf"}} {int(row[0])}'
            yield f'agentenv_operation_seconds_sum{{op="{op}"}} {row[1]:.6f}'
            yield f'agentenv_operation_seconds_count{{op="{op}"}} {int(row[0])}'


class Service:
    """What the routes share: a cache of Sandbox objects, the quotas, the TTL reaper and the metrics."""

    def __init__(self, max_sandboxes: int, max_memory: int, reap_interval: float) -> None:
        self.max_sandboxes, self.max_memory, self.reap_interval = max_sandboxes, max_memory, reap_interval
        self.metrics = Metrics()
        self.recovered: dict[str, list[str]] = {"running": [], "paused": [], "lost": []}
        self._cache: dict[str, Sandbox] = {}
        self._lock = threading.Lock()
        self._pending = [0, 0]  # sandboxes and bytes of memory reserved by operations in flight
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    # lookup
    def sandbox(self, sandbox_id: str) -> Sandbox:
        """The cached Sandbox of an id (its record is read once), SandboxNotFound if there is none."""
        sb = self._cache.get(sandbox_id)
        if sb is None:
            sb = Sandbox.get(sandbox_id)
            if not sb._container.bundle.exists():
                raise errors.SandboxNotFound(f"no sandbox {sandbox_id!r}")
            self._cache[sandbox_id] = sb
        return sb

    def remember(self, sb: Sandbox) -> Sandbox:
        self._cache[sb.id] = sb
        return sb

    def forget(self, sandbox_id: str) -> None:
        self._cache.pop(sandbox_id, None)

    def call(self, sandbox_id: str, fn: Callable[[Sandbox], Any]) -> Any:
        """Run ``fn`` on a sandbox; if its agent stopped answering, drop the cached object and say why."""
        sb = self.sandbox(sandbox_id)
        try:
            return fn(sb)
        except errors.ConnectionLost:
            self.forget(sandbox_id)
            fresh = self.sandbox(sandbox_id)
            state = fresh.state
            if state != "running":  # paused (e.g. by the TTL reaper) or closed by another process
                raise errors.SandboxStateError(f"sandbox {sandbox_id} is {state}",
                                               fix="resume() a paused sandbox; a lost or closed one is gone") from None
            raise

    # quotas
    def _usage(self) -> tuple[int, int]:
        live = mem = 0
        for sb in Sandbox.list():
            if sb._rec.get("state") == "running":
                live += 1
                mem += sb.limits.memory
        return live, mem

    def capacity(self) -> Capacity:
        live, mem = self._usage()
        live, mem = live + self._pending[0], mem + self._pending[1]
        return Capacity(max_sandboxes=self.max_sandboxes, live_sandboxes=live,
                        free_sandboxes=max(0, self.max_sandboxes - live), max_memory=self.max_memory,
                        memory_used=mem, free_memory=max(0, self.max_memory - mem))

    @contextlib.contextmanager
    def reserve(self, count: int, memory: int) -> Iterator[None]:
        """Hold room for ``count`` new live sandboxes using ``memory`` bytes each, or raise QuotaExceeded."""
        with self._lock:
            live, used = self._usage()
            live, used = live + self._pending[0], used + self._pending[1]
            if live + count > self.max_sandboxes:
                raise errors.QuotaExceeded(f"{live} of {self.max_sandboxes} sandboxes are live; {count} more do not fit",
                                           retry_after=RETRY_AFTER)
            if used + count * memory > self.max_memory:
                raise errors.QuotaExceeded(f"{used} of {self.max_memory} bytes of sandbox memory are in use; "
                                           f"{count} x {memory} more do not fit", retry_after=RETRY_AFTER)
            self._pending[0] += count
            self._pending[1] += count * memory
        try:
            yield
        finally:
            with self._lock:
                self._pending[0] -= count
                self._pending[1] -= count * memory

    # lifecycle
    def recover(self) -> None:
        """After a (re)start: clear crashed writers' leftovers, reattach running sandboxes, report lost ones."""
        for name in store.gc():
            log.warning("removed leftover %s of a crashed writer", name)
        for sb in Sandbox.list():
            state = sb.state
            if state == "running":
                try:
                    sb._channel.call({"op": "ping"})
                except errors.AgentEnvError:
                    state = "lost"
                else:
                    self.remember(sb)
            bucket = {"running": "running", "paused": "paused"}.get(state, "lost")
            self.recovered[bucket].append(sb.id)
        if self.recovered["lost"]:
            log.warning("lost sandboxes (their processes are gone; close them): %s", ", ".join(self.recovered["lost"]))
        log.info("reattached %d running sandboxes; %d paused; %d snapshots in the store",
                 len(self.recovered["running"]), len(self.recovered["paused"]), len(Snapshot.list()))

    def start_reaper(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self.reap_interval):
                try:
                    for sid in Sandbox.reap_expired():
                        self.forget(sid)
                        log.info("paused sandbox %s: its TTL expired", sid)
                except Exception:  # noqa: BLE001 - the reaper must outlive any one failure
                    log.exception("TTL reaper")

        self._reaper = threading.Thread(target=loop, name="agentenv-ttl-reaper", daemon=True)
        self._reaper.start()

    def stop(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)

    def prometheus(self) -> str:
        states: dict[str, int] = dict.fromkeys(("running", "paused", "lost", "creating"), 0)
        for sb in Sandbox.list():
            states[sb.state] = states.get(sb.state, 0) + 1
        snaps = Snapshot.list()
        lines = ["# HELP agentenv_sandboxes Sandboxes on this host by state.", "# TYPE agentenv_sandboxes gauge"]
        lines += [f'agentenv_sandboxes{{state="{k}"}} {v}' for k, v in sorted(states.items())]
        lines += ["# HELP agentenv_snapshots Snapshots in the store.", "# TYPE agentenv_snapshots gauge",
                  f"agentenv_snapshots {len(snaps)}",
                  "# HELP agentenv_snapshot_store_bytes Bytes used by the snapshot store.",
                  "# TYPE agentenv_snapshot_store_bytes gauge",
                  f"agentenv_snapshot_store_bytes {sum(s.size_bytes for s in snaps)}"]
        lines += list(self.metrics.lines())
        return "\n".join(lines) + "\n"


# --- wire plumbing ------------------------------------------------------------------------------------

_msgpack_reply: contextvars.ContextVar[bool] = contextvars.ContextVar("agentenv_msgpack_reply", default=False)


class WireResponse(Response):
    """A response in msgpack or JSON, whichever the request's Accept header asked for."""

    def __init__(self, content: Any, status_code: int = 200, headers: dict[str, str] | None = None,
                 msgpack_body: bool | None = None) -> None:
        mp = _msgpack_reply.get() if msgpack_body is None else msgpack_body
        super().__init__(content=wire.encode(content, mp), status_code=status_code, headers=headers,
                         media_type=wire.MSGPACK if mp else wire.JSON)


def _error_response(exc: BaseException, request: Request) -> Response:
    if isinstance(exc, StarletteHTTPException):
        return _http_error_response(exc, request)
    code = status_of(exc)
    if code is None:
        log.exception("unexpected error in %s %s", request.method, request.url.path, exc_info=exc)
        code = 500
    subject = request.path_params.get("sandbox_id") or request.path_params.get("snapshot_id")
    headers = {"Retry-After": f"{getattr(exc, 'retry_after', RETRY_AFTER):.0f}"} if code == 429 else None
    if code == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return WireResponse(error_body(exc, subject), code, headers,
                        msgpack_body=wire.wants_msgpack(request.headers.get("accept")))


def _http_error_response(exc: StarletteHTTPException, request: Request) -> Response:
    """Starlette's own errors (unknown route, method not allowed, unparsable body) in the same error format."""
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


def _invalid_response(exc: RequestValidationError) -> Response:
    return WireResponse({"error": "ValidationError", "message": _validation_message(exc),
                         "fix": "see the OpenAPI spec at /openapi.json", "id": None}, 422)


def _make_route_class(token: str, service: Service) -> type[APIRoute]:
    """Routes that check the token first, decode msgpack bodies, reply in the negotiated format and time themselves."""
    expected = f"Bearer {token}".encode()

    class WireRoute(APIRoute):
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
                        given = request.headers.get("authorization", "").encode()
                        if not hmac.compare_digest(given, expected):
                            raise errors.Unauthorized("missing or wrong bearer token",
                                                      fix="send 'Authorization: Bearer <token>'")
                    if decodes and wire.is_msgpack(request.headers.get("content-type")):
                        body = await request.body()
                        request._json = wire.decode(body, wire.MSGPACK) if body else None
                        request.scope["headers"] = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
                        request.scope["headers"].append((b"content-type", wire.JSON.encode()))
                        with contextlib.suppress(AttributeError):
                            del request._headers
                    return await handler(request)
                except RequestValidationError as e:
                    return _invalid_response(e)
                except Exception as e:  # noqa: BLE001 - mapped to a typed error response
                    return _error_response(e, request)
                finally:
                    _msgpack_reply.reset(reset)
                    service.metrics.observe(op, time.perf_counter() - started)

            return wire_handler

    return WireRoute


def _complete_openapi(app: FastAPI) -> None:
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


# --- the app ------------------------------------------------------------------------------------------

def _sandbox_info(sb: Sandbox, state: str | None = None) -> dict[str, Any]:
    lim = sb.limits
    return {"id": sb.id, "state": state or sb.state, "image": sb.image, "created_at": sb.created_at,
            "expires_at": sb.expires_at, "labels": sb.labels,
            "limits": {"cpus": lim.cpus, "memory": lim.memory, "pids": lim.pids}}


def _snapshot_info(s: Snapshot) -> dict[str, Any]:
    return {"id": s.id, "parent_id": s.parent_id, "created_at": s.created_at, "size_bytes": s.size_bytes,
            "has_memory": s.has_memory, "sandbox_id": s.sandbox_id, "labels": dict(s.labels)}


def _result_info(r: Any) -> dict[str, Any]:
    return {"exit_code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr, "duration": r.duration,
            "timed_out": r.timed_out}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    text = {401: "missing or wrong bearer token", 404: "no such sandbox, snapshot, file or process",
            409: "the operation does not fit the sandbox's state", 422: "the request does not match the schema",
            429: "quota exceeded: see Retry-After", 507: "the snapshot store is full",
            400: "bad input (e.g. a path with a NUL byte, an invalid size)"}
    out: dict[int | str, dict[str, Any]] = {c: {"model": ErrorBody, "description": text[c]} for c in codes}
    out["default"] = {"model": ErrorBody, "description": "any other error, with its class, message and fix"}
    return out


def create_app(token: str, *, max_sandboxes: int = 64, max_memory: str | int = "64g",
               reap_interval: float = 5.0) -> FastAPI:
    """The environment server's app; ``token`` guards every route but /health and /metrics."""
    if not token:
        raise ValueError("the server needs a bearer token (--token-file or $AGENTENV_TOKEN)")
    service = Service(max_sandboxes, parse_size(max_memory), reap_interval)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(service.recover)
        service.start_reaper()
        yield
        service.stop()

    app = FastAPI(title="agentenv environment server", version=__version__, lifespan=lifespan,
                  description="Sandboxes that snapshot, fork and resume, over HTTP. Bodies are JSON or msgpack "
                              "(Content-Type / Accept: application/msgpack).",
                  default_response_class=WireResponse)
    app.state.service = service
    app.router.route_class = _make_route_class(token, service)
    sb_errors = _errors(400, 401, 404, 409, 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return _http_error_response(exc, request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        token = _msgpack_reply.set(wire.wants_msgpack(request.headers.get("accept")))
        try:
            return _invalid_response(exc)
        finally:
            _msgpack_reply.reset(token)

    # open routes
    @app.get("/health", tags=["server"], responses={200: {"content": {wire.JSON: {"schema": {"type": "object"}}}}})
    def health() -> Response:
        return WireResponse({"status": "ok", "version": __version__})

    @app.get("/metrics", tags=["server"], response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus"}})
    def metrics() -> Response:
        return Response(service.prometheus(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/server", tags=["server"], response_model=ServerInfo, responses=_errors(401))
    def server_info() -> Response:
        return WireResponse({"version": __version__, "capacity": service.capacity().model_dump(),
                             "recovered": service.recovered})

    # sandboxes
    @app.post("/v1/sandboxes", tags=["sandboxes"], response_model=SandboxInfo,
              responses=_errors(400, 401, 404, 422, 429))
    def create_sandbox(req: Annotated[CreateRequest, Body()]) -> Response:
        memory = parse_size(req.memory)
        with service.reserve(1, memory):
            sb = Sandbox.create(req.image, cpus=req.cpus, memory=memory, pids=req.pids, network=req.network,
                                env=req.env, workdir=req.workdir, ttl=req.ttl, labels=req.labels)
        return WireResponse(_sandbox_info(service.remember(sb), "running"))

    @app.get("/v1/sandboxes", tags=["sandboxes"], response_model=list[SandboxInfo],
             responses=_errors(401))
    def list_sandboxes() -> Response:
        return WireResponse([_sandbox_info(sb) for sb in Sandbox.list()])

    @app.get("/v1/sandboxes/{sandbox_id}", tags=["sandboxes"], response_model=SandboxInfo,
             responses=sb_errors)
    def get_sandbox(sandbox_id: SandboxId) -> Response:
        return WireResponse(_sandbox_info(service.sandbox(sandbox_id)))

    @app.delete("/v1/sandboxes/{sandbox_id}", tags=["sandboxes"], response_model=Deleted,
                responses=sb_errors)
    def close_sandbox(sandbox_id: SandboxId) -> Response:
        sb = service.sandbox(sandbox_id)
        sb.close()
        service.forget(sandbox_id)
        return WireResponse({"id": sandbox_id, "state": "closed"})

    @app.post("/v1/sandboxes/{sandbox_id}/exec", tags=["commands"],
              response_model=ExecResultInfo, responses=sb_errors)
    def exec_command(sandbox_id: SandboxId, req: Annotated[ExecRequest, Body()]) -> Response:
        r = service.call(sandbox_id, lambda sb: sb.exec(req.command, timeout=req.timeout, cwd=req.cwd, env=req.env))
        return WireResponse(_result_info(r))

    @app.post("/v1/sandboxes/{sandbox_id}/exec/stream", tags=["commands"],
              response_class=StreamingResponse, responses={
                  200: {"description": "frames {stream, data} as output comes, then {result} or {error}: "
                                       "concatenated msgpack objects, or JSON lines (data in base64)",
                        "content": {wire.NDJSON: {"schema": {"type": "string"}},
                                    wire.MSGPACK: {"schema": {"type": "string", "format": "binary"}}}},
                  **sb_errors})
    async def exec_stream(sandbox_id: SandboxId, req: Annotated[ExecRequest, Body()]) -> Response:
        sb = await run_in_threadpool(service.sandbox, sandbox_id)
        if sb._rec.get("state") != "running":
            sb._require_running()
        mp = _msgpack_reply.get()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        def on_output(stream: str, data: bytes) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, {"stream": stream, "data": data})

        def run() -> None:
            try:
                r = service.call(sandbox_id, lambda s: s.exec(req.command, timeout=req.timeout, cwd=req.cwd,
                                                                env=req.env, on_output=on_output))
                final: dict[str, Any] = {"result": _result_info(r)}
            except Exception as e:  # noqa: BLE001 - sent to the client as the last frame
                final = {"error": error_body(e, sandbox_id)}
            loop.call_soon_threadsafe(queue.put_nowait, final)
            loop.call_soon_threadsafe(queue.put_nowait, None)

        task = loop.run_in_executor(None, run)

        async def frames() -> AsyncIterator[bytes]:
            while (item := await queue.get()) is not None:
                yield wire.frame(item, mp)
            await task

        return StreamingResponse(frames(), media_type=wire.MSGPACK if mp else wire.NDJSON)

    @app.post("/v1/sandboxes/{sandbox_id}/spawn", tags=["commands"], response_model=ProcessInfo,
              responses=sb_errors)
    def spawn(sandbox_id: SandboxId, req: Annotated[SpawnRequest, Body()]) -> Response:
        p = service.call(sandbox_id, lambda sb: sb.spawn(req.command, cwd=req.cwd, env=req.env))
        return WireResponse({"pid": p.pid, "log": p.log, "command": p.command, "exit_code": None})

    @app.get("/v1/sandboxes/{sandbox_id}/processes", tags=["commands"],
             response_model=list[ProcessInfo], responses=sb_errors)
    def processes(sandbox_id: SandboxId) -> Response:
        def run(sb: Sandbox) -> list[dict[str, Any]]:
            sb._require_running()
            return [_process_info(p) for p in sb.processes()]
        return WireResponse(service.call(sandbox_id, run))

    @app.get("/v1/sandboxes/{sandbox_id}/processes/{pid}", tags=["commands"],
             response_model=ProcessInfo, responses=sb_errors)
    def process(sandbox_id: SandboxId, pid: Annotated[int, PathParam(ge=1, le=1 << 22)]) -> Response:
        return WireResponse(service.call(sandbox_id, lambda sb: _process_info(_find_process(sb, pid))))

    @app.post("/v1/sandboxes/{sandbox_id}/processes/{pid}/kill", tags=["commands"],
              response_model=ProcessInfo, responses=sb_errors)
    def kill(sandbox_id: SandboxId, pid: Annotated[int, PathParam(ge=1, le=1 << 22)],
             req: Annotated[KillRequest, Body()]) -> Response:
        def run(sb: Sandbox) -> dict[str, Any]:
            p = _find_process(sb, pid)
            p.kill(req.signal)
            return _process_info(p)
        return WireResponse(service.call(sandbox_id, run))

    @app.get("/v1/sandboxes/{sandbox_id}/files", tags=["files"], response_class=Response,
             responses={200: {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                   "format": "binary"}}},
                              "description": "the file's bytes"}, **sb_errors})
    def download(sandbox_id: SandboxId, path: FilePath) -> Response:
        data = service.call(sandbox_id, lambda sb: sb.read_file(path))
        return Response(data, media_type="application/octet-stream")

    @app.put("/v1/sandboxes/{sandbox_id}/files", tags=["files"], response_model=FileWritten,
             responses={**sb_errors, 413: {"model": ErrorBody, "description": "the upload is too large"}},
             openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": {
                 "schema": {"type": "string", "format": "binary"}}}}})
    async def upload(request: Request, sandbox_id: SandboxId, path: FilePath,
                     mode: Annotated[int, Query(ge=0, le=0o7777, description="permission bits")] = 0o644) -> Response:
        if int(request.headers.get("content-length") or 0) > MAX_UPLOAD:
            return WireResponse({"error": "PayloadTooLarge", "message": f"uploads are limited to {MAX_UPLOAD} bytes",
                                 "fix": None, "id": sandbox_id}, 413)
        data = await request.body()
        await run_in_threadpool(service.call, sandbox_id, lambda sb: sb.write_file(path, data, mode=mode))
        return WireResponse({"path": path, "size": len(data)})

    @app.post("/v1/sandboxes/{sandbox_id}/snapshot", tags=["snapshots"],
              response_model=SnapshotInfo, responses=_errors(400, 401, 404, 409, 422, 507))
    def snapshot(sandbox_id: SandboxId, req: Annotated[SnapshotRequest, Body()]) -> Response:
        snap = service.call(sandbox_id, lambda sb: sb.snapshot(memory=req.memory, labels=req.labels))
        return WireResponse(_snapshot_info(snap))

    @app.post("/v1/sandboxes/{sandbox_id}/fork", tags=["snapshots"],
              response_model=list[SandboxInfo], responses=_errors(400, 401, 404, 409, 422, 429, 507))
    def fork(sandbox_id: SandboxId, req: Annotated[ForkRequest, Body()]) -> Response:
        sb = service.sandbox(sandbox_id)
        with service.reserve(req.count, sb.limits.memory):
            kids = service.call(sandbox_id, lambda s: s.fork(req.count, memory=req.memory))
        return WireResponse([_sandbox_info(service.remember(k), "running") for k in kids])

    @app.post("/v1/sandboxes/{sandbox_id}/pause", tags=["snapshots"],
              response_model=SnapshotInfo, responses=_errors(400, 401, 404, 409, 422, 507))
    def pause(sandbox_id: SandboxId) -> Response:
        return WireResponse(_snapshot_info(service.call(sandbox_id, lambda sb: sb.pause())))

    @app.post("/v1/sandboxes/{sandbox_id}/resume", tags=["snapshots"],
              response_model=SandboxInfo, responses=_errors(400, 401, 404, 409, 422, 429))
    def resume(sandbox_id: SandboxId) -> Response:
        sb = service.sandbox(sandbox_id)
        with service.reserve(1, sb.limits.memory):
            sb.resume()
        return WireResponse(_sandbox_info(sb, "running"))

    @app.post("/v1/sandboxes/{sandbox_id}/ttl", tags=["sandboxes"], response_model=SandboxInfo,
              responses=sb_errors)
    def set_ttl(sandbox_id: SandboxId, req: Annotated[TTLRequest, Body()]) -> Response:
        sb = service.sandbox(sandbox_id)
        sb.set_ttl(req.ttl)
        return WireResponse(_sandbox_info(sb))

    # snapshots
    @app.get("/v1/snapshots", tags=["snapshots"], response_model=list[SnapshotInfo],
             responses=_errors(401))
    def list_snapshots() -> Response:
        return WireResponse([_snapshot_info(s) for s in Snapshot.list()])

    @app.get("/v1/snapshots/{snapshot_id}", tags=["snapshots"], response_model=SnapshotInfo,
             responses=_errors(401, 404, 422))
    def get_snapshot(snapshot_id: SnapshotId) -> Response:
        return WireResponse(_snapshot_info(Snapshot.get(snapshot_id)))

    @app.delete("/v1/snapshots/{snapshot_id}", tags=["snapshots"], response_model=Deleted,
                responses=_errors(401, 404, 422))
    def delete_snapshot(snapshot_id: SnapshotId,
                        background: Annotated[bool, Query(description="remove the files off the request")] = False,
                        ) -> Response:
        Snapshot.get(snapshot_id).delete(background=background)
        return WireResponse({"id": snapshot_id, "state": "deleted"})

    @app.post("/v1/snapshots/{snapshot_id}/restore", tags=["snapshots"],
              response_model=SandboxInfo, responses=_errors(400, 401, 404, 422, 429))
    def restore(snapshot_id: SnapshotId, req: Annotated[RestoreRequest, Body()]) -> Response:
        snap = Snapshot.get(snapshot_id)
        memory = int(snap.spec.get("limits", {}).get("memory", 1 << 30))
        with service.reserve(1, memory):
            sb = Sandbox.restore(snap, labels=req.labels)
        return WireResponse(_sandbox_info(service.remember(sb), "running"))

    _complete_openapi(app)
    return app


def _find_process(sb: Sandbox, pid: int) -> Process:
    sb._require_running()
    for p in sb.processes():
        if p.pid == pid:
            return p
    raise ProcessLookupError(f"no process {pid} started with spawn in sandbox {sb.id}")


def _process_info(p: Process) -> dict[str, Any]:
    return {"pid": p.pid, "log": p.log, "command": p.command, "exit_code": p.exit_code}


# --- running it ---------------------------------------------------------------------------------------

def load_token(token_file: Path | None) -> str:
    """The bearer token from ``token_file``, else $AGENTENV_TOKEN; ValueError when there is none."""
    token = token_file.read_text().strip() if token_file is not None else os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(f"no token: pass --token-file or set ${TOKEN_ENV} (the server never runs open)")
    return token


def serve(token: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *, max_sandboxes: int = 64,
          max_memory: str | int = "64g", reap_interval: float = 5.0, log_level: str = "info") -> None:
    """Run the server until interrupted (uvicorn, one process; sandbox calls run in its thread pool)."""
    import uvicorn

    app = create_app(token, max_sandboxes=max_sandboxes, max_memory=max_memory, reap_interval=reap_interval)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)
