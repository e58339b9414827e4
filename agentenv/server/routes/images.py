"""Images: make sure one is on this server's host (from its local store, a tarball, a mirror or a registry, with a
deadline: ``agentenv.host.image_store``), report what the images take on disk, evict the least recently used.

Where images come from is the server's own setting (``agentenv serve --image-mirror / --image-tarballs /
--no-image-pull``), never a request's: a client names the image, not a registry or a file of the host. Prewarming a
fleet (``agentenv.remote.prewarm``) calls ``/v1/images/ensure`` on every server."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from fastapi import APIRouter, Body, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool
from starlette.concurrency import run_in_threadpool

from agentenv.api import ImageFetch
from agentenv.host import image_store
from agentenv.server.routing import WireResponse, WireRoute
from agentenv.server.schemas import Int, Seconds, error_responses

router = APIRouter(route_class=WireRoute, tags=["images"])
IMAGE_NAME = r"^[a-z0-9]+([._/:@-][A-Za-z0-9_]+|[._-]{2}[a-z0-9]+)*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$"


class EnsureRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image: str = Field(max_length=512, pattern=IMAGE_NAME, description="a Docker image reference")
    deadline: Seconds | None = Field(None, description="seconds a pull may take (at most the server's own)")


class EvictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    budget: Int = Field(ge=0, description="bytes the images' layers may take after the eviction")
    only_fetched: StrictBool = Field(True, description="only images agentenv loaded or pulled itself")
    dry_run: StrictBool = False


def sources(request: Request, deadline: float | None) -> image_store.ImageSources:
    own: image_store.ImageSources = request.app.state.image_sources
    return own if deadline is None else dataclasses.replace(own, deadline=min(deadline, own.deadline))


@router.post("/v1/images/ensure", response_model=ImageFetch, responses=error_responses(400, 401, 404, 422))
async def ensure_image(request: Request, req: Annotated[EnsureRequest, Body()]) -> Response:
    got = await run_in_threadpool(image_store.ensure, req.image, sources(request, req.deadline))
    return WireResponse(got.to_wire())


def _stored(img: image_store.StoredImage) -> dict[str, object]:
    return {**dataclasses.asdict(img), "tags": list(img.tags), "unique": img.unique}


@router.get("/v1/images", responses=error_responses(401))
async def image_usage() -> Response:
    now = await run_in_threadpool(image_store.usage)
    return WireResponse({"total": now.total, "images": [_stored(i) for i in now.images]})


@router.post("/v1/images/evict", responses=error_responses(400, 401, 422))
async def evict_images(req: Annotated[EvictRequest, Body()]) -> Response:
    gone = await run_in_threadpool(lambda: image_store.evict(req.budget, only_fetched=req.only_fetched,
                                                             dry_run=req.dry_run))
    return WireResponse({"removed": [_stored(i) for i in gone]})
