"""Jobs in a sandbox: start (on a terminal too), list, read output (streamed, from byte offsets), discard, stdin,
signals and a terminal's size.

A job's output waits in the sandbox's keeper until read, so ``output`` may be called again later (after a
pause and resume, from another client) from the offsets reached. Its stream runs in a thread of its own
(``agentenv.server.streaming``), never in one of the event loop's pool threads, however long the job lasts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from agentenv import errors, wire
from agentenv.api import JobInfo, JobOutput
from agentenv.inside.jobs import MAX_OUTPUT
from agentenv.sandbox.core import Sandbox
from agentenv.server.routes import BINARY, ServiceDep
from agentenv.server.routes.sandboxes import SB_ERRORS
from agentenv.server.routing import WireResponse, WireRoute, reply_in_msgpack
from agentenv.server.schemas import (
    DiscardRequest,
    ErrorBody,
    JobDone,
    KillRequest,
    OutputRequest,
    Pid,
    ResizeRequest,
    SandboxId,
    StartRequest,
)
from agentenv.server.streaming import iterate

router = APIRouter(route_class=WireRoute, tags=["jobs"])
TailSize = Annotated[int, Query(ge=1, le=MAX_OUTPUT, description="bytes at most, the last of each stream")]


@router.post("/v1/sandboxes/{sandbox_id}/jobs", response_model=JobInfo, responses=SB_ERRORS)
def start(service: ServiceDep, sandbox_id: SandboxId, req: Annotated[StartRequest, Body()]) -> Response:
    if req.pty is not None:  # a terminal: its input is always open (what is typed at it)
        rows, cols = req.pty
        job = service.call(sandbox_id, lambda sb: sb.start_terminal(req.command, (rows, cols), cwd=req.cwd,
                                                                     env=req.env, timeout=req.timeout, tag=req.tag))
    else:
        job = service.call(sandbox_id, lambda sb: sb.start(req.command, cwd=req.cwd, env=req.env,
                                                            timeout=req.timeout, stdin=req.stdin, tag=req.tag))
    return WireResponse(job.to_wire())


@router.get("/v1/sandboxes/{sandbox_id}/jobs", response_model=list[JobInfo], responses=SB_ERRORS)
def jobs(service: ServiceDep, sandbox_id: SandboxId) -> Response:
    return WireResponse(service.call(sandbox_id, lambda sb: [j.to_wire() for j in sb.jobs()]))


@router.post("/v1/sandboxes/{sandbox_id}/jobs/{pid}/output", response_class=StreamingResponse, responses={
    200: {"description": "frames {stream, data, offset} as output comes and {heartbeat: true} while none does, "
                         "then {end: {exit_code, timed_out, duration}}, {running: true} (not following, the job "
                         "goes on) or {error}: concatenated msgpack objects, or JSON lines (data in base64)",
          "content": {wire.NDJSON: {"schema": {"type": "string"}},
                      wire.MSGPACK: {"schema": {"type": "string", "format": "binary"}}}},
    **SB_ERRORS})
async def output(service: ServiceDep, sandbox_id: SandboxId, pid: Pid,
                 req: Annotated[OutputRequest, Body()]) -> Response:
    sb = await run_in_threadpool(service.call, sandbox_id, lambda sb: _job(sb, pid))  # a 404 or 409 now
    reader = sb.output(pid, None if req.offsets is None else (req.offsets[0], req.offsets[1]), follow=req.follow)
    mp = reply_in_msgpack()

    async def frames() -> AsyncIterator[bytes]:
        final: dict[str, Any] = {"running": True}
        try:
            async for item in iterate(lambda: reader):  # interrupted when the client leaves: the job's end stays
                if item is None:
                    yield wire.frame({"heartbeat": True}, mp)
                elif isinstance(item, JobOutput):
                    yield wire.frame(item.to_wire(), mp)
                else:
                    final = {"end": item.to_wire()}
        except Exception as e:  # noqa: BLE001 - sent to the client as the last frame
            final = {"error": errors.to_wire(await run_in_threadpool(service.failed, sandbox_id, e), sandbox_id)}
        yield wire.frame(final, mp)

    return StreamingResponse(frames(), media_type=wire.MSGPACK if mp else wire.NDJSON)


@router.get("/v1/sandboxes/{sandbox_id}/jobs/{pid}/tail", response_model=list[JobOutput], responses=SB_ERRORS)
def tail(service: ServiceDep, sandbox_id: SandboxId, pid: Pid, size: TailSize = 64 << 10) -> Response:
    """The last ``size`` bytes of each stream of a job, left for ``output`` (and the job's end with them)."""
    return WireResponse(service.call(sandbox_id, lambda sb: [o.to_wire() for o in sb.tail(pid, size)]))


@router.post("/v1/sandboxes/{sandbox_id}/jobs/{pid}/discard", response_model=JobDone, responses=SB_ERRORS)
def discard(service: ServiceDep, sandbox_id: SandboxId, pid: Pid, req: Annotated[DiscardRequest, Body()]) -> Response:
    service.call(sandbox_id, lambda sb: sb.discard(pid, (req.offsets[0], req.offsets[1])))
    return WireResponse({"pid": pid})


@router.post("/v1/sandboxes/{sandbox_id}/jobs/{pid}/input", response_model=JobDone,
             responses={**SB_ERRORS, 413: {"model": ErrorBody, "description": "the body is over 32 MiB"}},
             openapi_extra={"requestBody": {"required": True, "content": BINARY}})
async def send_input(service: ServiceDep, request: Request, sandbox_id: SandboxId, pid: Pid) -> Response:
    data = await request.body()  # at most limits.MAX_BODY bytes: BodyLimit fails the request past that
    await run_in_threadpool(service.call, sandbox_id, lambda sb: sb.send_input(pid, data))
    return WireResponse({"pid": pid, "size": len(data)})


@router.post("/v1/sandboxes/{sandbox_id}/jobs/{pid}/close-input", response_model=JobDone, responses=SB_ERRORS)
def close_input(service: ServiceDep, sandbox_id: SandboxId, pid: Pid) -> Response:
    service.call(sandbox_id, lambda sb: sb.close_input(pid))
    return WireResponse({"pid": pid})


@router.post("/v1/sandboxes/{sandbox_id}/jobs/{pid}/resize", response_model=JobDone, responses=SB_ERRORS)
def resize(service: ServiceDep, sandbox_id: SandboxId, pid: Pid, req: Annotated[ResizeRequest, Body()]) -> Response:
    rows, cols = req.size
    service.call(sandbox_id, lambda sb: sb.resize(pid, (rows, cols)))
    return WireResponse({"pid": pid})


@router.post("/v1/sandboxes/{sandbox_id}/jobs/{pid}/signal", response_model=JobDone, responses=SB_ERRORS)
def signal(service: ServiceDep, sandbox_id: SandboxId, pid: Pid, req: Annotated[KillRequest, Body()]) -> Response:
    service.call(sandbox_id, lambda sb: sb.signal(pid, req.signal))
    return WireResponse({"pid": pid})


def _job(sb: Sandbox, pid: int) -> Sandbox:
    """``sb``, if it has a job ``pid`` to read (ProcessLookupError if not)."""
    if any(job.pid == pid for job in sb.jobs()):
        return sb
    raise ProcessLookupError(f"no job {pid} in sandbox {sb.id} (never started, or its end was read already)")
