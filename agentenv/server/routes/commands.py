"""Commands in a sandbox: exec (whole, or streamed as it runs), spawn, and the spawned processes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Body, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from agentenv import errors, wire
from agentenv.api import ExecResult, ProcessInfo
from agentenv.sandbox.core import Process, Sandbox
from agentenv.server.routes import ServiceDep
from agentenv.server.routes.sandboxes import SB_ERRORS
from agentenv.server.routing import WireResponse, WireRoute, reply_in_msgpack
from agentenv.server.schemas import ExecRequest, KillRequest, Pid, SandboxId, SpawnRequest

router = APIRouter(route_class=WireRoute, tags=["commands"])


@router.post("/v1/sandboxes/{sandbox_id}/exec", response_model=ExecResult, responses=SB_ERRORS)
def exec_command(service: ServiceDep, sandbox_id: SandboxId, req: Annotated[ExecRequest, Body()]) -> Response:
    r = service.call(sandbox_id, lambda sb: sb.exec(req.command, timeout=req.timeout, cwd=req.cwd, env=req.env))
    return WireResponse(r.to_wire())


@router.post("/v1/sandboxes/{sandbox_id}/exec/stream", response_class=StreamingResponse, responses={
    200: {"description": "frames {stream, data} as output comes, then {result} or {error}: "
                         "concatenated msgpack objects, or JSON lines (data in base64)",
          "content": {wire.NDJSON: {"schema": {"type": "string"}},
                      wire.MSGPACK: {"schema": {"type": "string", "format": "binary"}}}},
    **SB_ERRORS})
async def exec_stream(service: ServiceDep, sandbox_id: SandboxId, req: Annotated[ExecRequest, Body()]) -> Response:
    sb = await run_in_threadpool(service.sandbox, sandbox_id)
    if sb.recorded_state != "running":
        sb.require_running()  # a 409 now, before the stream starts
    mp = reply_in_msgpack()
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def on_output(stream: str, data: bytes) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, {"stream": stream, "data": data})

    def run() -> None:
        try:
            r = service.call(sandbox_id, lambda s: s.exec(req.command, timeout=req.timeout, cwd=req.cwd,
                                                            env=req.env, on_output=on_output))
            final: dict[str, Any] = {"result": r.to_wire()}
        except Exception as e:  # noqa: BLE001 - sent to the client as the last frame
            final = {"error": errors.to_wire(e, sandbox_id)}
        loop.call_soon_threadsafe(queue.put_nowait, final)
        loop.call_soon_threadsafe(queue.put_nowait, None)

    task = loop.run_in_executor(None, run)

    async def frames() -> AsyncIterator[bytes]:
        while (item := await queue.get()) is not None:
            yield wire.frame(item, mp)
        await task

    return StreamingResponse(frames(), media_type=wire.MSGPACK if mp else wire.NDJSON)


@router.post("/v1/sandboxes/{sandbox_id}/spawn", response_model=ProcessInfo, responses=SB_ERRORS)
def spawn(service: ServiceDep, sandbox_id: SandboxId, req: Annotated[SpawnRequest, Body()]) -> Response:
    p = service.call(sandbox_id, lambda sb: sb.spawn(req.command, cwd=req.cwd, env=req.env))
    return WireResponse(ProcessInfo(pid=p.pid, log=p.log, command=p.command, exit_code=None).to_wire())


@router.get("/v1/sandboxes/{sandbox_id}/processes", response_model=list[ProcessInfo], responses=SB_ERRORS)
def processes(service: ServiceDep, sandbox_id: SandboxId) -> Response:
    return WireResponse(service.call(sandbox_id, lambda sb: [p.info().to_wire() for p in sb.processes()]))


@router.get("/v1/sandboxes/{sandbox_id}/processes/{pid}", response_model=ProcessInfo, responses=SB_ERRORS)
def process(service: ServiceDep, sandbox_id: SandboxId, pid: Pid) -> Response:
    return WireResponse(service.call(sandbox_id, lambda sb: _find(sb, pid).info().to_wire()))


@router.post("/v1/sandboxes/{sandbox_id}/processes/{pid}/kill", response_model=ProcessInfo, responses=SB_ERRORS)
def kill(service: ServiceDep, sandbox_id: SandboxId, pid: Pid, req: Annotated[KillRequest, Body()]) -> Response:
    def run(sb: Sandbox) -> dict[str, Any]:
        p = _find(sb, pid)
        p.kill(req.signal)
        return p.info().to_wire()
    return WireResponse(service.call(sandbox_id, run))


def _find(sb: Sandbox, pid: int) -> Process:
    for p in sb.processes():
        if p.pid == pid:
            return p
    raise ProcessLookupError(f"no process {pid} started with spawn in sandbox {sb.id}")
