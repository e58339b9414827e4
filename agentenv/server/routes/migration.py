"""Post-copy migration between servers (``agentenv.sandbox.migration``): the source dumps a sandbox lazily and
serves its pages on its loopback to the holder of the migration's key, which its reply names (``migrate``); the
receiver imports the snapshot (``/v1/snapshots/import``), restores it lazily from that page server with the key
(``receive``) and says when every page is in (``memory``); the source then closes its copy, or, if the receiver
did not get every page, resumes it (``migrate/finish``). ``agentenv.Pool``'s ``move(..., post_copy=True)`` makes
these calls. The key travels only in these calls' bodies, never with the snapshot."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query, Response

from agentenv.api import SandboxInfo
from agentenv.errors import SnapshotNotFound
from agentenv.sandbox import migration
from agentenv.server.routes import ServiceDep
from agentenv.server.routing import WireResponse, WireRoute
from agentenv.server.schemas import (
    MemoryIn,
    MigrateFinish,
    MigrationFinished,
    MigrationStarted,
    ReceiveRequest,
    SandboxId,
    SnapshotId,
    error_responses,
)
from agentenv.snapshot import shared

router = APIRouter(route_class=WireRoute, tags=["migration"])


@router.post("/v1/sandboxes/{sandbox_id}/migrate", response_model=MigrationStarted,
             responses=error_responses(400, 401, 404, 409, 422, 507))
def migrate(service: ServiceDep, sandbox_id: SandboxId) -> Response:
    """Dump the sandbox lazily: its snapshot (to import elsewhere) and where its pages are served. It stays
    frozen here until ``migrate/finish`` (or the page server's deadline, after which it runs on here)."""
    out = service.call(sandbox_id, migration.send)
    return WireResponse({"snapshot": out.snapshot.info().to_wire(),
                         "page_server": f"{out.server.address}:{out.server.port}", "key": out.key.hex()})


@router.post("/v1/snapshots/{snapshot_id}/receive", response_model=SandboxInfo,
             responses=error_responses(400, 401, 404, 422, 429, 501))
def receive(service: ServiceDep, snapshot_id: SnapshotId, req: Annotated[ReceiveRequest, Body()]) -> Response:
    """Restore a post-copy migration's snapshot (imported here first): it runs at once, its pages pulled from the
    source's page server, which takes the migration's ``key`` alone."""
    sb = service.restore(shared.get(snapshot_id), labels=req.labels, ttl=req.ttl,
                         page_server_key=bytes.fromhex(req.key))
    return WireResponse(sb.info("running").to_wire())


@router.post("/v1/sandboxes/{sandbox_id}/migrate/finish", response_model=MigrationFinished,
             responses=error_responses(400, 401, 404, 422))
def finish(service: ServiceDep, sandbox_id: SandboxId, req: Annotated[MigrateFinish, Body()]) -> Response:
    """End a migration: with ``delivered``, the sandbox is closed here (``moved``); else it runs on here."""
    out = migration.outgoing.get(req.snapshot)
    if out is None or out.sb.id != sandbox_id:
        raise SnapshotNotFound(f"no migration of sandbox {sandbox_id} with snapshot {req.snapshot!r} is under way "
                               "here (it ended: its deadline passed, or it was finished)")
    moved = out.finish(req.delivered)
    if moved:
        service.forget(sandbox_id)
    return WireResponse({"id": sandbox_id, "moved": moved})


@router.get("/v1/sandboxes/{sandbox_id}/memory", response_model=MemoryIn, responses=error_responses(401, 404, 422))
def memory(service: ServiceDep, sandbox_id: SandboxId,
           wait: Annotated[float, Query(ge=0, le=migration.ALL_IN_TIMEOUT, description="seconds to wait")] = 0.0,
           ) -> Response:
    """Whether a sandbox restored from a migration's snapshot has every page (``all_in``), waiting up to ``wait``."""
    return WireResponse({"id": sandbox_id, "all_in": service.call(sandbox_id, lambda sb: migration.all_in(sb, wait))})
