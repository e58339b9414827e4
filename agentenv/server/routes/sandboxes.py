"""Sandboxes: create, list, get, close, their time to live and their outbound network rules."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Response

from agentenv.api import SandboxInfo
from agentenv.config import parse_disk, parse_size
from agentenv.sandbox import migration
from agentenv.sandbox.core import Sandbox
from agentenv.server.routes import ServiceDep
from agentenv.server.routing import WireResponse, WireRoute
from agentenv.server.schemas import (
    CreateRequest,
    Deleted,
    NetworkRequest,
    SandboxId,
    TTLRequest,
    error_responses,
)

router = APIRouter(route_class=WireRoute, tags=["sandboxes"])
SB_ERRORS = error_responses(400, 401, 404, 409, 422)


@router.post("/v1/sandboxes", response_model=SandboxInfo, responses=error_responses(400, 401, 403, 404, 422, 429, 501))
def create_sandbox(service: ServiceDep, req: Annotated[CreateRequest, Body()]) -> Response:
    memory, disk = parse_size(req.memory), parse_disk(req.disk)
    service.check_disk(disk)
    network = req.network if isinstance(req.network, bool) else req.network.model_dump()
    with service.reserve(1, memory, disk):
        sb = Sandbox.create(req.image, cpus=req.cpus, memory=memory, pids=req.pids, disk=disk, network=network,
                            env=req.env, workdir=req.workdir, ttl=req.ttl, labels=req.labels,
                            share_memory=req.share_memory)
    return WireResponse(service.remember(sb).info("running").to_wire())


@router.get("/v1/sandboxes", response_model=list[SandboxInfo], responses=error_responses(401))
def list_sandboxes() -> Response:
    return WireResponse([sb.info().to_wire() for sb in Sandbox.list()])


@router.get("/v1/sandboxes/{sandbox_id}", response_model=SandboxInfo, responses=SB_ERRORS)
def get_sandbox(service: ServiceDep, sandbox_id: SandboxId) -> Response:
    return WireResponse(service.sandbox(sandbox_id).info().to_wire())


@router.delete("/v1/sandboxes/{sandbox_id}", response_model=Deleted, responses=SB_ERRORS)
def close_sandbox(service: ServiceDep, sandbox_id: SandboxId) -> Response:
    if (out := migration.under_way(sandbox_id)) is not None:  # its page server ends first; it stays here
        out.finish(False)
    service.sandbox(sandbox_id).close()
    service.forget(sandbox_id)
    return WireResponse({"id": sandbox_id, "state": "closed"})


@router.post("/v1/sandboxes/{sandbox_id}/ttl", response_model=SandboxInfo, responses=SB_ERRORS)
def set_ttl(service: ServiceDep, sandbox_id: SandboxId, req: Annotated[TTLRequest, Body()]) -> Response:
    sb = service.sandbox(sandbox_id)
    sb.set_ttl(req.ttl)
    return WireResponse(sb.info().to_wire())


@router.put("/v1/sandboxes/{sandbox_id}/network", response_model=SandboxInfo,
            responses=error_responses(400, 401, 404, 409, 422, 501))
def update_network(service: ServiceDep, sandbox_id: SandboxId, req: Annotated[NetworkRequest, Body()]) -> Response:
    """Replace the sandbox's outbound rules (at once if it runs; a paused one gets them when it resumes).
    400 NetworkRuleError for a rule that cannot be enforced (nothing changed), 409 for a sandbox made without
    network."""
    sb = service.sandbox(sandbox_id)
    service.call(sandbox_id, lambda s: s.update_network(req.allow_out, req.deny_out))
    return WireResponse(sb.info().to_wire())
