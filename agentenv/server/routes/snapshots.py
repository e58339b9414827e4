"""Snapshots: take one, fork, pause and resume a sandbox; list, get, delete and restore snapshots."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query, Response

from agentenv.api import SandboxInfo, SnapshotInfo
from agentenv.sandbox.store import Snapshot
from agentenv.server.routes import ServiceDep
from agentenv.server.routing import WireResponse, WireRoute
from agentenv.server.schemas import (
    Deleted,
    ForkRequest,
    RestoreRequest,
    SandboxId,
    SnapshotId,
    SnapshotRequest,
    error_responses,
)

router = APIRouter(route_class=WireRoute, tags=["snapshots"])


@router.post("/v1/sandboxes/{sandbox_id}/snapshot", response_model=SnapshotInfo,
             responses=error_responses(400, 401, 404, 409, 422, 507))
def snapshot(service: ServiceDep, sandbox_id: SandboxId, req: Annotated[SnapshotRequest, Body()]) -> Response:
    snap = service.call(sandbox_id, lambda sb: sb.snapshot(memory=req.memory, labels=req.labels))
    return WireResponse(snap.info().to_wire())


@router.post("/v1/sandboxes/{sandbox_id}/fork", response_model=list[SandboxInfo],
             responses=error_responses(400, 401, 404, 409, 422, 429, 501, 507))
def fork(service: ServiceDep, sandbox_id: SandboxId, req: Annotated[ForkRequest, Body()]) -> Response:
    return WireResponse([k.info("running").to_wire() for k in service.fork(sandbox_id, req.count, req.memory)])


@router.post("/v1/sandboxes/{sandbox_id}/pause", response_model=SnapshotInfo,
             responses=error_responses(400, 401, 404, 409, 422, 507))
def pause(service: ServiceDep, sandbox_id: SandboxId) -> Response:
    return WireResponse(service.call(sandbox_id, lambda sb: sb.pause()).info().to_wire())


@router.post("/v1/sandboxes/{sandbox_id}/resume", response_model=SandboxInfo,
             responses=error_responses(400, 401, 404, 409, 422, 429, 501))
def resume(service: ServiceDep, sandbox_id: SandboxId) -> Response:
    return WireResponse(service.resume(sandbox_id).info("running").to_wire())


@router.get("/v1/snapshots", response_model=list[SnapshotInfo], responses=error_responses(401))
def list_snapshots() -> Response:
    return WireResponse([s.info().to_wire() for s in Snapshot.list()])


@router.get("/v1/snapshots/{snapshot_id}", response_model=SnapshotInfo, responses=error_responses(401, 404, 422))
def get_snapshot(snapshot_id: SnapshotId) -> Response:
    return WireResponse(Snapshot.get(snapshot_id).info().to_wire())


@router.delete("/v1/snapshots/{snapshot_id}", response_model=Deleted, responses=error_responses(401, 404, 422))
def delete_snapshot(snapshot_id: SnapshotId,
                    background: Annotated[bool, Query(description="remove the files off the request")] = False,
                    ) -> Response:
    Snapshot.get(snapshot_id).delete(background=background)
    return WireResponse({"id": snapshot_id, "state": "deleted"})


@router.post("/v1/snapshots/{snapshot_id}/restore", response_model=SandboxInfo,
             responses=error_responses(400, 401, 404, 422, 429, 501))
def restore(service: ServiceDep, snapshot_id: SnapshotId, req: Annotated[RestoreRequest, Body()]) -> Response:
    sb = service.restore(Snapshot.get(snapshot_id), labels=req.labels)
    return WireResponse(sb.info("running").to_wire())
