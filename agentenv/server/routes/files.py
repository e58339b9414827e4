"""Files in a sandbox: download and upload whole files (paths resolved inside the sandbox)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool

from agentenv.server.routes import ServiceDep
from agentenv.server.routes.sandboxes import SB_ERRORS
from agentenv.server.routing import WireResponse, WireRoute
from agentenv.server.schemas import ErrorBody, FilePath, FileWritten, SandboxId

router = APIRouter(route_class=WireRoute, tags=["files"])
_BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}


@router.get("/v1/sandboxes/{sandbox_id}/files", response_class=Response,
            responses={200: {"content": _BINARY, "description": "the file's bytes"}, **SB_ERRORS})
def download(service: ServiceDep, sandbox_id: SandboxId, path: FilePath) -> Response:
    data = service.call(sandbox_id, lambda sb: sb.read_file(path))
    return Response(data, media_type="application/octet-stream")


@router.put("/v1/sandboxes/{sandbox_id}/files", response_model=FileWritten,
            responses={**SB_ERRORS, 413: {"model": ErrorBody, "description": "the upload is over 1 GiB"}},
            openapi_extra={"requestBody": {"required": True, "content": _BINARY}})
async def upload(service: ServiceDep, request: Request, sandbox_id: SandboxId, path: FilePath,
                 mode: Annotated[int, Query(ge=0, le=0o7777, description="permission bits")] = 0o644) -> Response:
    data = await request.body()  # at most limits.MAX_UPLOAD bytes: BodyLimit fails the request past that
    await run_in_threadpool(service.call, sandbox_id, lambda sb: sb.write_file(path, data, mode=mode))
    return WireResponse({"path": path, "size": len(data)})
