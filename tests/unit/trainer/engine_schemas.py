"""The engines' weight-reload request schemas, written as strict pydantic models (unknown fields and coerced types
refused) from reading the released sources that ``policy.reload`` names (vLLM 0.33.0, SGLang 0.5.23), and stand-in
engines on FastAPI that enforce them: a request off the schema gets HTTP 422, as the engines' FastAPI routes answer.

The stand-ins keep what a real engine keeps (the folder loaded, the weight version, paused or not) and can be told
to refuse, to fail, or to hang until released, so the client's error handling and deadlines are tested against a
real HTTP server on 127.0.0.1."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SGLangUpdateWeightFromDisk(Strict):
    """SGLang 0.5.23 ``UpdateWeightFromDiskReqInput`` (io_struct.py; with ``BaseReq``'s rid and http_worker_ipc)."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, object] | None = None
    rid: str | None = None
    http_worker_ipc: str | None = None


class SGLangUpdateWeightFromDiskOutput(Strict):
    """Its answer (``UpdateWeightFromDiskReqOutput`` as http_server.py returns it: 200, or 400 when refused)."""

    success: bool
    message: str
    num_paused_requests: int = 0


class VLLMReloadWeightsKwargs(Strict):
    """vLLM 0.33.0 ``GPUModelRunner.reload_weights`` keyword arguments that a JSON string can carry: the route passes
    kwargs as strings only, so ``weights_iterator`` cannot travel and ``is_checkpoint_format`` must be left out (the
    string "False" would be true)."""

    weights_path: str


class VLLMCollectiveRPC(Strict):
    """vLLM 0.33.0 ``POST /collective_rpc`` (serve/dev/rpc/api_router.py): method, string args and kwargs, timeout."""

    method: str
    args: list[str] = []
    kwargs: dict[str, str] = {}
    timeout: float | None = None


class VLLMUpdateWeightVersion(Strict):
    """vLLM 0.33.0 ``POST /update_weight_version`` (rl/online/api_router.py): ``new_version`` embedded in the body."""

    new_version: str


@dataclass
class Engine:
    """What a stand-in engine holds, and how it is told to misbehave."""

    key: str | None = None
    loaded: list[str] = field(default_factory=list)
    files: list[list[str]] = field(default_factory=list)   # the file names of each folder loaded, when loaded
    version: str = "default"
    paused: bool = False
    calls: list[tuple[str, str, dict[str, str], object]] = field(default_factory=list)
    refuse: str = ""              # SGLang: answer success false with this message; vLLM: the RPC fails with it
    hang: threading.Event | None = None   # set: the load waits for it (released at the test's end)
    ignore_version: bool = False  # SGLang: load, but keep reporting the old weight version

    def check(self, request: Request, body: object, authorization: str | None) -> None:
        self.calls.append((request.method, request.url.path, dict(request.query_params), body))
        if self.key and authorization != f"Bearer {self.key}":
            raise HTTPException(401, "missing or wrong API key")

    def load(self, path: str) -> str:
        """'' when ``path`` is a checkpoint folder with its config.json (what both engines read first), else why not."""
        if self.hang is not None:
            self.hang.wait(60)
        if self.refuse:
            return self.refuse
        if not (Path(path) / "config.json").is_file():
            return f"Failed to get weights iterator: {path} has no config.json"
        self.loaded.append(path)
        self.files.append(sorted(p.name for p in Path(path).iterdir()))
        return ""


def sglang_app(engine: Engine) -> FastAPI:
    """SGLang's reload route and the model info that reports the weight version."""
    app = FastAPI()

    @app.post("/update_weights_from_disk")
    def update(obj: SGLangUpdateWeightFromDisk, request: Request, authorization: str | None = Header(None)):
        engine.check(request, obj.model_dump(exclude_unset=True), authorization)
        why = engine.load(obj.model_path)
        if not why and obj.weight_version is not None and not engine.ignore_version:
            engine.version = obj.weight_version
        out = SGLangUpdateWeightFromDiskOutput(success=not why, message=why or "Succeeded to update model weights.")
        return JSONResponse(out.model_dump(), status_code=400 if why else 200)

    @app.get("/model_info")
    def model_info(request: Request, authorization: str | None = Header(None)):
        engine.check(request, None, authorization)
        return {"model_path": engine.loaded[-1] if engine.loaded else "", "weight_version": engine.version,
                "is_generation": True}

    return app


def add_vllm_routes(app: FastAPI, engine: Engine) -> FastAPI:
    """vLLM's dev-mode routes a folder reload goes through: pause, collective_rpc, update_weight_version, resume,
    weight_info (on ``app``, which may already serve completions)."""

    async def no_body(request: Request) -> None:
        if await request.body():
            raise HTTPException(422, "this route takes no body")

    @app.post("/pause")
    async def pause(request: Request, mode: Literal["abort", "wait", "keep"] = Query("abort"),
                    clear_cache: bool = Query(True), authorization: str | None = Header(None)):
        await no_body(request)
        engine.check(request, None, authorization)
        engine.paused = True
        return {"status": "paused"}

    @app.post("/resume")
    async def resume(request: Request, authorization: str | None = Header(None)):
        await no_body(request)
        engine.check(request, None, authorization)
        engine.paused = False
        return {"status": "resumed"}

    @app.post("/collective_rpc")
    def rpc(body: VLLMCollectiveRPC, request: Request, authorization: str | None = Header(None)):
        engine.check(request, body.model_dump(exclude_unset=True), authorization)
        if body.method != "reload_weights" or body.args:
            raise HTTPException(422, "this stand-in serves reload_weights with keyword arguments only")
        try:
            kwargs = VLLMReloadWeightsKwargs.model_validate(body.kwargs)
        except ValidationError as e:
            raise HTTPException(422, str(e)) from e
        why = engine.load(kwargs.weights_path)
        if why:
            return JSONResponse({"error": {"message": why, "type": "InternalServerError", "code": 500}}, 500)
        return {"results": [None, None]}     # one per worker: reload_weights returns None

    @app.post("/update_weight_version")
    def update_version(body: VLLMUpdateWeightVersion, request: Request, authorization: str | None = Header(None)):
        engine.check(request, body.model_dump(), authorization)
        engine.version = body.new_version
        return {"success": True, "new_version": body.new_version}

    @app.get("/weight_info")
    def weight_info(request: Request, authorization: str | None = Header(None)):
        engine.check(request, None, authorization)
        return {"weight_version": engine.version}

    return app


def vllm_app(engine: Engine) -> FastAPI:
    return add_vllm_routes(FastAPI(), engine)
