"""The code interpreter's port (49999): ``/execute`` streaming NDJSON, and ``/contexts``, over kernels that
live inside the sandbox.

A context is a persistent Python process (``agentenv.inside.kernel``) run as a job of the sandbox's agent (as
E2B's ``user`` where the image has that account, else root: ``bridge.acting``), with its
stdin fed requests and its stdout read for events; it is found again by its job tag, so the server keeps no
state of its own. Because the kernel is an ordinary process of the sandbox, a memory snapshot, a pause or a
fork carries its variables: every child of a fork starts with the interpreter state of the moment it forked.
Executions in one context run one at a time; a client that leaves mid-execution (the SDK's timeout)
interrupts the kernel (SIGINT), and what the interrupted execution still prints is skipped by the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, Router

from agentenv.api import JobEnd, JobOutput
from agentenv.inside import kernel
from agentenv.sandbox.calls import AsUser
from agentenv.sandbox.core import Sandbox
from agentenv.server.e2b.bridge import acting, iterate, run, user_named
from agentenv.server.e2b.files import http_error
from agentenv.server.service import Service

TAG = "e2b-context:"
DEFAULT = "default"
LANGUAGES = ("python", "py", "")


def _find(sb: Sandbox, context_id: str) -> int | None:
    for job in sb.jobs():
        if job.tag == TAG + context_id and job.exit_code is None:
            return job.pid
    return None


def _contexts(sb: Sandbox) -> list[dict[str, Any]]:
    return [{"id": j.tag.removeprefix(TAG), "language": "python", "cwd": j.cwd or "/"}
            for j in sb.jobs() if j.tag and j.tag.startswith(TAG) and j.exit_code is None]


def _start(sb: Sandbox, context_id: str, cwd: str | None, user: str | None) -> str:
    """Start a context's kernel as the account ``user`` names (``bridge.acting``: E2B's ``user`` by default,
    where the image has it); the folder it starts in (that account's home unless ``cwd``)."""
    calls = acting(sb, user)
    cwd = cwd or (calls.home if isinstance(calls, AsUser) else None)
    command, env = kernel.launch()
    calls.start(command, cwd=cwd, env=env, stdin=True, tag=TAG + context_id)
    return cwd or "/"


def _kernel(sb: Sandbox, context_id: str | None, user: str | None) -> int:
    """The pid of a context's kernel; the default context is started on first use."""
    cid = context_id or DEFAULT
    pid = _find(sb, cid)
    if pid is None:
        if cid != DEFAULT:
            raise FileNotFoundError(2, f"no context {cid!r}: create it with create_code_context()")
        _start(sb, cid, None, user)
        pid = _find(sb, cid)
        assert pid is not None
    return pid


class Interpreter:
    """The routes of port 49999 for every sandbox (the sandbox comes from the request's headers)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        # a context's lock lives while an execution holds it: ids a client made up leave nothing behind
        self.locks: weakref.WeakValueDictionary[tuple[str, str], asyncio.Lock] = weakref.WeakValueDictionary()

    def _sandbox(self, request: Request) -> Sandbox:
        return self.service.sandbox(request.headers.get("e2b-sandbox-id", ""))

    async def execute(self, request: Request) -> Response:
        try:
            body = _object(await request.json())
            code, language = body.get("code"), body.get("language") or ""
            if not isinstance(code, str):
                raise ValueError("code must be a string")
            if language not in LANGUAGES:
                raise ValueError(f"language {language!r} is not supported here: only python")
            env_vars, context_id = body.get("env_vars") or {}, body.get("context_id") or DEFAULT
            if not isinstance(env_vars, dict) or not isinstance(context_id, str):
                raise ValueError("env_vars must be an object and context_id a string")
            env = {str(k): str(v) for k, v in env_vars.items()}
            sb = await run(self._sandbox, request)
            lock = self.locks.setdefault((sb.id, context_id), asyncio.Lock())
        except Exception as e:  # noqa: BLE001 - an error body the SDK maps
            return http_error(e)
        return StreamingResponse(self._run(sb, context_id, code, env, lock, user_named(request.headers)),
                                 media_type="application/x-ndjson")

    async def _run(self, sb: Sandbox, context_id: str, code: str, env: dict[str, str],
                   lock: asyncio.Lock, user: str | None) -> AsyncIterator[bytes]:
        """The execution's events as NDJSON lines; a failure of the sandbox is the last line, as an error."""
        try:
            async for line in self._execute(sb, context_id, code, env, lock, user):
                yield line
        except Exception as e:  # noqa: BLE001 - the stream has started: the failure is told in it
            yield _line({"type": "error", "name": type(e).__name__, "value": str(e), "traceback": ""})

    async def _execute(self, sb: Sandbox, context_id: str, code: str, env: dict[str, str],
                       lock: asyncio.Lock, user: str | None) -> AsyncIterator[bytes]:
        async with lock:
            pid = await run(_kernel, sb, context_id, user)
            rid = uuid.uuid4().hex
            await run(sb.send_input, pid, kernel.request(rid, code, env))
            done = False
            buf, base, err_end = bytearray(), None, 0
            try:
                async for item in iterate(lambda: sb.output(pid)):
                    if isinstance(item, JobEnd):
                        yield _line({"type": "error", "name": "KernelDied", "value": f"the interpreter exited with "
                                     f"{item.exit_code}; the next execution starts a new one", "traceback": ""})
                        done = True
                        return
                    if not isinstance(item, JobOutput):
                        continue
                    if item.stream == "stderr":
                        err_end = item.offset + len(item.data)
                        continue
                    if base is None:
                        base = item.offset
                    buf += item.data
                    if len(buf) > kernel.MAX_LINE:
                        raise ValueError(f"the interpreter wrote a line over {kernel.MAX_LINE} bytes")
                    events, used = kernel.split_events(bytes(buf))
                    del buf[:used]
                    base += used
                    for event in events:
                        if event.pop("id", None) != rid:
                            continue  # left over from an execution whose client went away
                        if event.get("type") == "end":
                            done = True
                            with contextlib.suppress(ProcessLookupError):  # its end was read ahead: forgotten
                                await run(sb.discard, pid, (base, err_end))
                            return
                        yield _line(event)
            finally:
                if not done:  # the client left (its timeout): interrupt what still runs
                    await asyncio.shield(run(_interrupt, sb, pid))

    async def create(self, request: Request) -> Response:
        try:
            body = _object(await request.json() if await request.body() else {})
            if (body.get("language") or "python") not in LANGUAGES[:2]:
                raise ValueError(f"language {body.get('language')!r} is not supported here: only python")
            cwd = body.get("cwd") or None
            if not isinstance(cwd, str | None):
                raise ValueError("cwd must be a string")
            sb = await run(self._sandbox, request)
            context_id = uuid.uuid4().hex[:16]
            cwd = await run(_start, sb, context_id, cwd, user_named(request.headers))
        except Exception as e:  # noqa: BLE001 - an error body the SDK maps
            return http_error(e)
        return JSONResponse({"id": context_id, "language": "python", "cwd": cwd})

    async def list(self, request: Request) -> Response:
        try:
            sb = await run(self._sandbox, request)
            return JSONResponse(await run(_contexts, sb))
        except Exception as e:  # noqa: BLE001 - an error body the SDK maps
            return http_error(e)

    async def remove(self, request: Request) -> Response:
        try:
            sb = await run(self._sandbox, request)
            pid = await run(_kernel_or_404, sb, request.path_params["context_id"])
            await run(sb.signal, pid, signal.SIGKILL)
        except Exception as e:  # noqa: BLE001 - an error body the SDK maps
            return http_error(e)
        return Response(status_code=204)

    async def restart(self, request: Request) -> Response:
        try:
            sb = await run(self._sandbox, request)
            cid = request.path_params["context_id"]
            pid = await run(_kernel_or_404, sb, cid)
            cwd = next((c["cwd"] for c in await run(_contexts, sb) if c["id"] == cid), None)
            await run(sb.signal, pid, signal.SIGKILL)
            await run(_drain, sb, pid)
            await run(_start, sb, cid, cwd, user_named(request.headers))
        except Exception as e:  # noqa: BLE001 - an error body the SDK maps
            return http_error(e)
        return Response(status_code=204)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    return body


def _kernel_or_404(sb: Sandbox, context_id: str) -> int:
    pid = _find(sb, context_id)
    if pid is None:
        raise FileNotFoundError(2, f"no context {context_id!r}")
    return pid


def _interrupt(sb: Sandbox, pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, OSError):
        sb.signal(pid, signal.SIGINT)


def _drain(sb: Sandbox, pid: int) -> None:
    """Read a killed kernel's job to its end, so that the agent forgets it (a stream that followed the job
    may have read its end first: then it is forgotten already)."""
    with contextlib.suppress(ProcessLookupError):
        for item in sb.output(pid):
            if isinstance(item, JobEnd):
                return


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event).encode() + b"\n"


def routes(service: Service) -> Router:
    api = Interpreter(service)

    async def health(request: Request) -> Response:
        return Response(status_code=204)

    return Router(routes=[
        Route("/health", health, methods=["GET"]), Route("/execute", api.execute, methods=["POST"]),
        Route("/contexts", api.create, methods=["POST"]), Route("/contexts", api.list, methods=["GET"]),
        Route("/contexts/{context_id}", api.remove, methods=["DELETE"]),
        Route("/contexts/{context_id}/restart", api.restart, methods=["POST"])])
