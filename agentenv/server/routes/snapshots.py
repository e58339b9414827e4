"""Snapshots: take one, fork, pause and resume a sandbox; list, get, delete and restore snapshots; export one in
chunks and import one from another server (``agentenv.snapshot.transfer``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query, Response
from fastapi import Path as PathParam

from agentenv.api import SandboxInfo, SnapshotInfo
from agentenv.errors import SnapshotNotFound
from agentenv.server.pull import pull
from agentenv.server.routes import ServiceDep
from agentenv.server.routing import WireResponse, WireRoute
from agentenv.server.schemas import (
    Deleted,
    ForkRequest,
    ImportRequest,
    ImportResult,
    RestoreRequest,
    SandboxId,
    SnapshotId,
    SnapshotRequest,
    error_responses,
)
from agentenv.snapshot import shared, transfer
from agentenv.snapshot.store import Snapshot

router = APIRouter(route_class=WireRoute, tags=["snapshots"])


@router.post("/v1/sandboxes/{sandbox_id}/snapshot", response_model=SnapshotInfo,
             responses=error_responses(400, 401, 404, 409, 422, 507))
def snapshot(service: ServiceDep, sandbox_id: SandboxId, req: Annotated[SnapshotRequest, Body()]) -> Response:
    snap = service.call(sandbox_id, lambda sb: sb.snapshot(memory=req.memory, labels=req.labels))
    return WireResponse(snap.info().to_wire())


@router.post("/v1/sandboxes/{sandbox_id}/fork", response_model=list[SandboxInfo],
             responses=error_responses(400, 401, 404, 409, 422, 429, 501, 507))
def fork(service: ServiceDep, sandbox_id: SandboxId, req: Annotated[ForkRequest, Body()]) -> Response:
    return WireResponse([k.info("running").to_wire() for k in service.fork(sandbox_id, req.count, req.memory, req.ttl)])


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
    """A snapshot of this server's store, else one of the shared store (``--shared-store``: a restore imports it)."""
    try:
        return WireResponse(Snapshot.get(snapshot_id).info().to_wire())
    except SnapshotNotFound:
        if (found := shared.info(snapshot_id)) is None:
            raise
        return WireResponse(found)


@router.delete("/v1/snapshots/{snapshot_id}", response_model=Deleted, responses=error_responses(401, 404, 422))
def delete_snapshot(snapshot_id: SnapshotId,
                    background: Annotated[bool, Query(description="remove the files off the request")] = False,
                    ) -> Response:
    try:
        Snapshot.get(snapshot_id).delete(background=background)  # its packed archive and shared copy too, if any
    except SnapshotNotFound:
        if not shared.drop(snapshot_id):  # one only in the shared store (its server is gone)
            raise
    return WireResponse({"id": snapshot_id, "state": "deleted"})


@router.post("/v1/snapshots/{snapshot_id}/restore", response_model=SandboxInfo,
             responses=error_responses(400, 401, 403, 404, 422, 429, 501, 502))
def restore(service: ServiceDep, snapshot_id: SnapshotId, req: Annotated[RestoreRequest, Body()]) -> Response:
    sb = service.restore(shared.get(snapshot_id), labels=req.labels, ttl=req.ttl)  # imported from the shared store if need be
    return WireResponse(sb.info("running").to_wire())


Chunk = Annotated[int, Query(ge=transfer.MIN_CHUNK, le=transfer.MAX_CHUNK, description="bytes per chunk")]


@router.get("/v1/snapshots/{snapshot_id}/export", responses=error_responses(400, 401, 404, 422))
def export_manifest(snapshot_id: SnapshotId, chunk: Chunk = transfer.CHUNK) -> Response:
    """The snapshot packed for another server: its size and every chunk's sha256 (packed on the first call)."""
    return WireResponse(transfer.export(snapshot_id, chunk))


@router.get("/v1/snapshots/{snapshot_id}/export/{index}", response_class=Response,
            responses={**error_responses(400, 401, 404, 422),
                       200: {"content": {"application/octet-stream": {}}, "description": "the chunk's bytes"}})
def export_chunk(snapshot_id: SnapshotId, index: Annotated[int, PathParam(ge=0, le=1 << 24)],
                 chunk: Chunk = transfer.CHUNK) -> Response:
    return Response(transfer.read_chunk(snapshot_id, index, chunk), media_type="application/octet-stream")


@router.delete("/v1/snapshots/{snapshot_id}/export", response_model=Deleted, responses=error_responses(401, 422))
def drop_export(snapshot_id: SnapshotId) -> Response:
    """Remove the packed archive (the receiver calls this once it has every chunk)."""
    transfer.drop_export(snapshot_id)
    return WireResponse({"id": snapshot_id, "state": "deleted"})


@router.post("/v1/snapshots/import", response_model=ImportResult,
             responses=error_responses(400, 401, 403, 404, 409, 422, 502, 507))
def import_snapshot(req: Annotated[ImportRequest, Body()]) -> Response:
    """Pull a snapshot from the server at ``source``; a cut-off import resumes from the chunks it had. Refused (403)
    unless sealed with the key the two servers share, or holding what no agentenv server packs (docs/transfer.md)."""
    snap, counts = pull(req.source, req.token, req.id, chunk=req.chunk_size, retries=req.retries,
                        keep_export=req.keep_export, resumable=req.resumable)
    return WireResponse({"snapshot": snap.info().to_wire(), **counts})
