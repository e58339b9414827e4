"""The server itself: health and Prometheus metrics (open), version and capacity (behind the token)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from agentenv import __version__, wire
from agentenv.server.routes import ServiceDep
from agentenv.server.routing import WireResponse, WireRoute
from agentenv.server.schemas import ServerInfo, error_responses

router = APIRouter(route_class=WireRoute, tags=["server"])


@router.get("/health", responses={200: {"content": {wire.JSON: {"schema": {"type": "object"}}}}})
def health() -> Response:
    return WireResponse({"status": "ok", "version": __version__})


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus"}})
def metrics(service: ServiceDep) -> Response:
    return Response(service.prometheus(), media_type="text/plain; version=0.0.4")


@router.get("/v1/server", response_model=ServerInfo, responses=error_responses(401))
def server_info(service: ServiceDep) -> Response:
    return WireResponse({"version": __version__, "capacity": service.capacity().model_dump(),
                         "recovered": service.recovered_now()})
