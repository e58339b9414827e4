"""``create_app``: the routes of the policy server, its bearer-token check and its error format.

A wrong token spends its sender's budget of failed authentication (``policy.authlimit``, the env server's own):
once spent, that client's user is answered 429 before any token of it is checked. No docs page is served
(FastAPI's load Swagger UI and ReDoc from a CDN); ``/openapi.json`` is the spec."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from policy.authlimit import AuthFailures, Spent
from policy.chat import Piece, chat_pieces, text_of
from policy.engine import Engine, SamplingParams
from policy.server.echo import Echo
from policy.server.responses import ChatAnswer, CompletionAnswer, Formatter
from policy.server.schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    UpdateWeightsRequest,
    bad,
    response_grammar,
    sampling_params,
    tool_grammar,
    tool_prompt,
)
from policy.server.streaming import Generation, generate, stream


def create_app(engine: Engine, token: str, model_name: str = "k3-mini",
               template: Callable[..., list[Piece]] = chat_pieces, echo: Echo | None = None) -> FastAPI:
    """Build the app around a running ``engine``; ``token`` guards every route but /health and /metrics.
    ``template`` renders chat messages to pieces (K3's ``chat_pieces``; a test swaps in a broken one). Text (a
    message's content, a text ``prompt``) is tokenised with its control-token strings as plain characters
    (``encode_text``): control ids come from the template's pieces, or from a client that sends token ids.
    ``echo``: the engine's own record of every finished sequence (``policy.server.echo``)."""
    app = FastAPI(title="agentenv policy (K3)", docs_url=None, redoc_url=None)
    app.state.auth_failures = failures = AuthFailures()
    tok = engine.tokenizer
    fmt = Formatter(tok, model_name)

    def auth(request: Request) -> None:
        given = request.headers.get("authorization", "")
        try:
            right = failures.matches(request.scope, given.encode(), f"Bearer {token}".encode())
        except Spent as e:
            raise HTTPException(429, detail=str(e), headers={"Retry-After": str(e.seconds)}) from None
        if not right:
            raise HTTPException(401, detail="missing or wrong bearer token")

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"error": {"message": exc.detail, "type": "invalid_request_error", "code": exc.status_code}},
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        reason = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in exc.errors())
        return JSONResponse({"error": {"message": reason, "type": "invalid_request_error", "code": 400}}, status_code=400)

    def start(prompt_ids: list[int], params: list[SamplingParams], grammar: Callable[[], str | None]) -> Generation:
        try:
            g = grammar()
            for p in params:
                p.grammar = g
            return generate(engine, prompt_ids, params, echo.write if echo is not None else None)
        except ValueError as e:
            raise bad(str(e)) from e

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "weight_version": engine.weight_version}

    @app.get("/metrics")
    def metrics() -> dict[str, Any]:
        return engine.metrics()

    @app.get("/v1/models", dependencies=[Depends(auth)])
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "agentenv",
                                            "max_model_len": engine.max_context}]}

    @app.post("/update_weights", dependencies=[Depends(auth)])
    async def update_weights(req: UpdateWeightsRequest) -> dict[str, Any]:
        try:
            version = await asyncio.to_thread(engine.update_weights, req.path, req.mode)
        except (ValueError, FileNotFoundError, OSError, RuntimeError) as e:
            raise bad(f"could not load weights: {e}") from e
        return {"ok": True, "weight_version": version}

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise bad(f"unknown model {name!r}; this server serves {model_name!r}", 404)

    @app.post("/tokenize", dependencies=[Depends(auth)])
    def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        """vLLM's route: the token ids the server would use for a text ``prompt`` or chat ``messages``."""
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad("give either 'prompt' or 'messages'")
        try:
            ids = tok.encode_text(req.prompt) if req.prompt is not None else tok.encode_pieces(template(
                req.messages or [], tool_prompt(ChatRequest(model=model_name, messages=[], tools=req.tools))[0],
                add_generation_prompt=req.add_generation_prompt))
        except (ValueError, AttributeError, TypeError, KeyError) as e:
            raise bad(f"bad request: {e}") from e
        return {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids}

    @app.post("/detokenize", dependencies=[Depends(auth)])
    def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        check_model(req.model)
        if any(not 0 <= t < tok.vocab_size for t in req.tokens):
            raise bad(f"token ids must be in [0, {tok.vocab_size})")
        return {"prompt": tok.decode(req.tokens)}

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)], response_model=None)
    async def chat(req: ChatRequest) -> Any:
        try:
            tools, forced = tool_prompt(req)
            prompt_ids = tok.encode_pieces([*template(req.messages, tools), *forced])
        except (ValueError, AttributeError, TypeError, KeyError) as e:
            raise bad(f"bad request: {e}") from e
        params = sampling_params(req, model_name, len(prompt_ids), engine.max_context)
        gen = start(prompt_ids, params, lambda: (tool_grammar(tools, req.tool_choice) if forced
                                                 else response_grammar(req.response_format)))
        answer = ChatAnswer(fmt, req, gen, text_of(forced), engine.weight_version)
        if req.stream:
            return StreamingResponse(stream(gen, answer), media_type="text/event-stream")
        await gen.wait()
        return answer.body()

    @app.post("/v1/completions", dependencies=[Depends(auth)], response_model=None)
    async def completions(req: CompletionRequest) -> Any:
        prompt_ids = tok.encode_text(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        params = sampling_params(req, model_name, len(prompt_ids), engine.max_context)
        gen = start(prompt_ids, params, lambda: response_grammar(req.response_format))
        answer = CompletionAnswer(fmt, req, gen, engine.weight_version)
        if req.stream:
            return StreamingResponse(stream(gen, answer), media_type="text/event-stream")
        await gen.wait()
        return answer.body()

    return app
