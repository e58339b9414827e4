"""The server's routes, one module per resource; each is an ``APIRouter`` of ``WireRoute``s."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from agentenv.server.service import Service


def _service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


ServiceDep = Annotated[Service, Depends(_service)]
BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}  # raw bytes, in or out
