"""Files in a sandbox: download and upload whole files, stat, list, make folders, move and remove (paths
resolved inside the sandbox)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query, Request, Response
from fastapi.concurrency import run_in_threadpool

from agentenv.api import FileInfo
from agentenv.server.routes import BINARY, ServiceDep
from agentenv.server.routing import WireResponse, WireRoute
from agentenv.server.schemas import (
    Depth,
    DirMade,
    ErrorBody,
    FilePath,
    FileWritten,
    MoveRequest,
    PathRequest,
    Removed,
    SandboxId,
    error_responses,
)

router = APIRouter(route_class=WireRoute, tags=["files"])
FILE_ERRORS = error_responses(400, 401, 403, 404, 409, 422)


@router.get("/v1/sandboxes/{sandbox_id}/files", response_class=Response,
            responses={200: {"content": BINARY, "description": "the file's bytes"}, **FILE_ERRORS})
def download(service: ServiceDep, sandbox_id: SandboxId, path: FilePath) -> Response:
    data = service.call(sandbox_id, lambda sb: sb.read_file(path))
    return Response(data, media_type="application/octet-stream")


@router.put("/v1/sandboxes/{sandbox_id}/files", response_model=FileWritten,
            responses={**FILE_ERRORS, 413: {"model": ErrorBody, "description": "the upload is over 1 GiB"}},
            openapi_extra={"requestBody": {"required": True, "content": BINARY}})
async def upload(service: ServiceDep, request: Request, sandbox_id: SandboxId, path: FilePath,
                 mode: Annotated[int, Query(ge=0, le=0o7777, description="permission bits")] = 0o644) -> Response:
    data = await request.body()  # at most limits.MAX_UPLOAD bytes: BodyLimit fails the request past that
    await run_in_threadpool(service.call, sandbox_id, lambda sb: sb.write_file(path, data, mode=mode))
    return WireResponse({"path": path, "size": len(data)})


@router.delete("/v1/sandboxes/{sandbox_id}/files", response_model=Removed, responses=FILE_ERRORS)
def remove(service: ServiceDep, sandbox_id: SandboxId, path: FilePath) -> Response:
    service.call(sandbox_id, lambda sb: sb.remove(path))
    return WireResponse({"path": path})


@router.get("/v1/sandboxes/{sandbox_id}/stat", response_model=FileInfo, responses=FILE_ERRORS)
def stat(service: ServiceDep, sandbox_id: SandboxId, path: FilePath) -> Response:
    return WireResponse(service.call(sandbox_id, lambda sb: sb.stat(path)).to_wire())


@router.get("/v1/sandboxes/{sandbox_id}/list", response_model=list[FileInfo], responses=FILE_ERRORS)
def list_dir(service: ServiceDep, sandbox_id: SandboxId, path: FilePath, depth: Depth = 1) -> Response:
    return WireResponse(service.call(sandbox_id, lambda sb: [f.to_wire() for f in sb.list_dir(path, depth)]))


@router.post("/v1/sandboxes/{sandbox_id}/mkdir", response_model=DirMade, responses=FILE_ERRORS)
def make_dir(service: ServiceDep, sandbox_id: SandboxId, req: Annotated[PathRequest, Body()]) -> Response:
    return WireResponse({"path": req.path, "made": service.call(sandbox_id, lambda sb: sb.make_dir(req.path))})


@router.post("/v1/sandboxes/{sandbox_id}/move", response_model=FileInfo, responses=FILE_ERRORS)
def move(service: ServiceDep, sandbox_id: SandboxId, req: Annotated[MoveRequest, Body()]) -> Response:
    return WireResponse(service.call(sandbox_id, lambda sb: sb.move(req.src, req.dst)).to_wire())
