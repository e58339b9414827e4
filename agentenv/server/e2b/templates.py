"""E2B's template API (``Template.build``, ``build_in_background``, ``get_build_status``, ``exists``, tags) over
builds in agentenv's own sandboxes on this host (``template_build``), with the records in ``template_store``.

The SDK asks for a build (``POST /v3/templates``), uploads the files of each ``copy`` to the URL that
``GET /templates/{id}/files/{hash}`` gives (this server's own ``/e2b/template-files/{hash}``, signed with an
HMAC of the server's token and valid for an hour, as E2B's presigned URLs are), starts the build
(``POST /v2/templates/{id}/builds/{build}``) and polls its status and logs. ``DELETE /templates/{id}`` removes a
built template, or a snapshot (E2B deletes snapshots as templates).
"""

from __future__ import annotations

import hashlib
import hmac
import tarfile
import threading
import time
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Body, Depends, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from agentenv.config import replacing
from agentenv.host.archives import UnsafeArchive
from agentenv.server.e2b import template_build, template_plan
from agentenv.server.e2b import template_store as store
from agentenv.server.e2b.control import CPUS, DISK, MEMORY
from agentenv.server.e2b.plane import E2BError, E2BRoute, ServiceDep, api_key, e2b_time
from agentenv.snapshot.store import Snapshot

UPLOAD_PATH = "/e2b/template-files"
UPLOAD_TTL = 3600  # seconds an upload URL is valid

router = APIRouter(tags=["e2b"], dependencies=[Depends(api_key)], include_in_schema=False, route_class=E2BRoute)
uploads = APIRouter(include_in_schema=False, route_class=E2BRoute)  # signed URLs, no API key (as S3's)


class _Strict(BaseModel):
    """A body whose unknown keys are refused (400 naming them), never accepted and ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class BuildRequest(_Strict):
    name: str | None = Field(None, max_length=256)
    alias: str | None = Field(None, max_length=256)
    tags: list[str] | None = Field(None, max_length=64)
    cpu_count: int | None = Field(None, alias="cpuCount", ge=1, le=64)
    memory_mb: int | None = Field(None, alias="memoryMB", ge=128, le=1 << 20)
    min_free_disk_mb: int | None = Field(None, alias="minFreeDiskMb", ge=0)


class Step(_Strict):
    type: str
    args: list[str] = Field(default_factory=list, max_length=4096)
    files_hash: str | None = Field(None, alias="filesHash")
    force: bool = False
    force_upload: bool | None = Field(None, alias="forceUpload")


class BuildStart(_Strict):
    from_image: str | None = Field(None, alias="fromImage", max_length=512)
    from_template: str | None = Field(None, alias="fromTemplate", max_length=256)
    from_image_registry: dict[str, Any] | None = Field(None, alias="fromImageRegistry")
    force: bool = False
    steps: list[Step] = Field(default_factory=list, max_length=1024)
    start_cmd: str | None = Field(None, alias="startCmd")
    ready_cmd: str | None = Field(None, alias="readyCmd")


class TagsBody(_Strict):
    target: str = Field(max_length=512)
    tags: list[str] = Field(min_length=1, max_length=64)


class UntagBody(_Strict):
    name: str = Field(max_length=512)
    tags: list[str] = Field(min_length=1, max_length=64)


def _signature(token: str, files_hash: str, expires: int) -> str:
    key = hmac.new(token.encode(), b"e2b-template-files", hashlib.sha256).digest()
    return hmac.new(key, f"{files_hash}:{expires}".encode(), hashlib.sha256).hexdigest()


@router.post("/v3/templates")
def request_build(body: Annotated[BuildRequest, Body()]) -> Response:
    """A new build of the template ``name[:tag]`` (the template is made on its first build), waiting for its steps."""
    name = body.name or body.alias
    if not name:
        raise E2BError(400, "a template build needs a name ('name' or 'name:tag')")
    if body.min_free_disk_mb is not None and body.min_free_disk_mb > DISK >> 20:
        raise E2BError(400, f"min_free_disk_mb {body.min_free_disk_mb} is more than the {DISK >> 20} MiB disk every "
                            "sandbox of this server gets (its image's files do not count against it)")
    cpus = float(body.cpu_count) if body.cpu_count else CPUS
    memory = body.memory_mb << 20 if body.memory_mb else MEMORY
    rec, build_id, tags = store.request(name, body.tags or [], cpus, memory)
    return JSONResponse({"templateID": rec["id"], "buildID": build_id, "public": False, "names": rec["names"],
                         "tags": tags, "aliases": rec["names"]}, 202)


@router.get("/templates/{template_id}/files/{files_hash}")
def upload_link(request: Request, template_id: str, files_hash: str) -> Response:
    """Whether the files of a ``copy`` are here already, and the signed URL to upload them to."""
    store.get(template_id)
    path = store.file_path(files_hash)
    expires = int(time.time()) + UPLOAD_TTL
    query = urlencode({"expires": expires, "signature": _signature(request.app.state.token, files_hash, expires)})
    url = f"{str(request.base_url).rstrip('/')}{UPLOAD_PATH}/{files_hash}?{query}"
    return JSONResponse({"present": path.is_file(), "url": url}, 201)


@uploads.put(UPLOAD_PATH + "/{files_hash}")
async def upload(request: Request, files_hash: str, expires: int, signature: str) -> Response:
    """The archive of a ``copy`` step's files, to the URL ``upload_link`` signed (a tar, gzipped or not); one that
    ``agentenv.host.archives`` refuses is a 400 naming the member, and is not kept."""
    if expires < time.time() or not hmac.compare_digest(signature, _signature(request.app.state.token, files_hash,
                                                                             expires)):
        raise E2BError(403, "the upload URL is expired or its signature is wrong: ask for a new one")
    with replacing(store.file_path(files_hash)) as f:  # kept only once it is checked
        async for chunk in request.stream():
            await run_in_threadpool(f.write, chunk)
        f.flush()
        if not await run_in_threadpool(tarfile.is_tarfile, f.name):
            raise E2BError(400, "the upload is not a tar archive (the SDK sends one, gzipped or not)")
        try:
            await run_in_threadpool(template_build.check_upload, Path(f.name))
        except (UnsafeArchive, tarfile.TarError) as e:
            raise E2BError(400, f"the upload is refused: {e}") from None
    return Response(status_code=200)


@router.post("/v2/templates/{template_id}/builds/{build_id}")
def start_build(service: ServiceDep, template_id: str, build_id: str, body: Annotated[BuildStart, Body()]) -> Response:
    """Start a requested build with its steps; it runs in the background, its status and logs at ``status``."""
    rec = store.get(template_id)
    build = store.build_of(rec, build_id)
    if build["status"] != "waiting":
        raise E2BError(409, f"build {build_id} was started already (it is {build['status']})")
    spec = body.model_dump(by_alias=True, exclude_none=True)
    template_plan.plan(spec.get("steps") or [])  # a step that cannot be built is a 400 now
    if body.ready_cmd is None and body.start_cmd is not None:
        raise E2BError(400, "a start command needs a ready command (set_start_cmd takes both)")
    files = sorted({s.files_hash for s in body.steps if s.files_hash})
    if store.update(rec["id"], build_id, status="building", files=files) is None:
        raise store.TemplateNotFound(f"template '{template_id}' was deleted")
    threading.Thread(target=template_build.run, args=(service, rec["id"], build_id, spec), daemon=True,
                     name=f"e2b-build-{build_id[:8]}").start()
    return Response(status_code=202)


@router.get("/templates/{template_id}/builds/{build_id}/status")
def build_status(template_id: str, build_id: str, logs_offset: Annotated[int, Query(alias="logsOffset", ge=0)] = 0,
                 limit: Annotated[int, Query(ge=1, le=100)] = 100, level: str | None = None) -> Response:
    """A build's status and its log entries from ``logsOffset`` (at most ``limit``); a failed one's reason."""
    if level not in (None, "debug", "info", "warn", "error"):
        raise E2BError(400, f"level {level!r} is not one of debug, info, warn, error")
    rec = store.get(template_id)
    build = store.build_of(rec, build_id)
    entries = store.logs(build_id, logs_offset, limit, level)
    body: dict[str, Any] = {"templateID": rec["id"], "buildID": build_id, "status": build["status"],
                            "logEntries": entries, "logs": [f"[{e['timestamp']}] {e['message']}" for e in entries]}
    if build["status"] == "error":
        reason = build.get("reason") or {"message": "Build failed"}
        tail = [e for e in store.logs(build_id, 0, 1 << 30) if e.get("step") == reason.get("step")][-20:]
        body["reason"] = {**reason, "logEntries": tail}
    return JSONResponse(body)


@router.get("/templates/aliases/{alias}")
def alias(alias: str) -> Response:
    """``Template.exists``: 200 with the template's id when a template has this name, else 404."""
    if alias in store.BUILTIN:
        return JSONResponse({"templateID": alias, "public": True})
    rec = store.find(alias)
    if rec is None:
        raise E2BError(404, f"template alias '{alias}' not found")
    return JSONResponse({"templateID": rec["id"], "public": False})


@router.get("/templates/{template_id}/tags")
def tags(template_id: str) -> Response:
    rec = store.get(template_id)
    rows = sorted(rec["tags"].items(), key=lambda kv: kv[1]["at"])
    return JSONResponse([{"tag": t, "buildID": v["build"], "createdAt": e2b_time(v["at"])} for t, v in rows])


@router.post("/templates/tags")
def assign_tags(body: Annotated[TagsBody, Body()]) -> Response:
    build_id, assigned = store.assign(body.target, body.tags)
    return JSONResponse({"tags": assigned, "buildID": build_id}, 201)


@router.delete("/templates/tags")
def remove_tags(body: Annotated[UntagBody, Body()]) -> Response:
    store.unassign(body.name, body.tags)
    return Response(status_code=204)


@router.delete("/templates/{template_id}")
def delete(template_id: str) -> Response:
    """A built template (its snapshots, and its images once nothing stands on them), or a snapshot."""
    if store.find(template_id) is not None:
        template_build.discard_template(store.remove(store.get(template_id)["id"]))
        return Response(status_code=204)
    Snapshot.get(template_id).delete(background=True)
    return Response(status_code=204)
