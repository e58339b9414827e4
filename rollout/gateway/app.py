"""The gateway's HTTP face: each session's routes under its capability, each API's own errors and streams.

A harness is given, for session ``S`` on ``http://127.0.0.1:PORT``:

- OpenAI (Chat Completions, Responses): ``OPENAI_BASE_URL=http://127.0.0.1:PORT/s/S/v1`` and the session's key;
- Anthropic (Messages, ``count_tokens``): ``ANTHROPIC_BASE_URL=http://127.0.0.1:PORT/s/S`` and the same key;
- ``GET .../v1/models`` in either API's shape (Anthropic's when the request carries ``anthropic-version``).

Any other path, an unknown session or a wrong key is answered 401, the same way. A bad request is a 400 in the
API's error format; an engine that failed is a 502 (504 past the call's deadline) and the session counts it (an
infrastructure failure, never the policy's). A stream begins only once the first event is ready, so a request the
gateway refuses gets its status code; a failure after that ends the stream with the API's error event.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from policy.client import PolicyError, PolicyTimeout
from rollout.gateway import admin, anthropic, openai_chat, responses
from rollout.gateway.messages import Answer, BadCall, Call, Delta
from rollout.gateway.sessions import Session, Unauthorized
from rollout.gateway.turns import Gateway

Events = Callable[[Call, AsyncIterator[Delta | Answer], Session, dict[str, Any]], AsyncIterator[dict[str, Any] | str]]


@dataclass(frozen=True)
class Api:
    """One API's reading, answer, stream and error format."""

    read: Callable[[dict[str, Any], Session], Call]
    body: Callable[[Call, Answer, Session], dict[str, Any]]
    events: Events
    error: Callable[[int, str], dict[str, Any]]
    named_events: bool               # SSE ``event:`` lines (Anthropic, Responses) or data only (Chat Completions)


def openai_error(status: int, message: str) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(status, "api_error")
    return {"error": {"message": message, "type": kind, "code": status}}


CHAT = Api(openai_chat.read, openai_chat.body, openai_chat.events, openai_error, False)
RESPONSES = Api(responses.read, responses.body, responses.events, openai_error, True)
MESSAGES = Api(anthropic.read, anthropic.body, anthropic.events, anthropic.error, True)


def body_hash(body: dict[str, Any]) -> str:
    """The request as a retry would send it again (key order aside)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _sse(item: dict[str, Any] | str, named: bool) -> str:
    if isinstance(item, str):
        return f"data: {item}\n\n"
    head = f"event: {item['type']}\n" if named else ""
    return f"{head}data: {json.dumps(item, ensure_ascii=False)}\n\n"


def create_app(gateway: Gateway, model_name: str = "k3-mini", admin_token: str | None = None) -> FastAPI:
    """The gateway's app; with ``admin_token``, also its admin routes (``rollout.gateway.admin``)."""
    app = FastAPI(title="agentenv LLM gateway", docs_url=None, redoc_url=None, openapi_url=None)
    if admin_token is not None:
        app.include_router(admin.router(gateway, admin_token))

    def session_of(request: Request, sid: str) -> Session:
        auth = request.headers.get("authorization", "")
        key = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        return gateway.sessions.get(sid, key)

    async def handle(request: Request, sid: str, api: Api,
                     answer: Callable[[Session, dict[str, Any]], Awaitable[Response]] | None = None) -> Response:
        try:
            session = session_of(request, sid)
        except Unauthorized as e:
            return JSONResponse(api.error(401, str(e)), status_code=401)
        try:
            raw = await request.json()
            if not isinstance(raw, dict):
                raise BadCall("the body must be a JSON object")
            if answer is not None:
                return await answer(session, raw)
            call = api.read(raw, session)
        except (BadCall, ValueError) as e:
            return JSONResponse(api.error(400, f"bad request: {e}"), status_code=400)
        session.asked_models.add(call.model)
        retry = request.headers.get("x-stainless-retry-count", "0") not in ("", "0")
        items = gateway.turn(session, call, body_hash(raw), retry)
        try:
            if not call.stream:
                final = [i async for i in items if isinstance(i, Answer)][-1]
                return JSONResponse(api.body(call, final, session))
            stream = api.events(call, items, session, raw)
            first = await anext(stream)
        except PolicyTimeout as e:
            return JSONResponse(api.error(504, f"the policy engine did not answer in time: {e}"), status_code=504)
        except PolicyError as e:
            return JSONResponse(api.error(502, f"the policy engine failed: {e}"), status_code=502)
        return StreamingResponse(_rest(first, stream, api), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _rest(first: dict[str, Any] | str, stream: AsyncIterator[dict[str, Any] | str],
                    api: Api) -> AsyncIterator[str]:
        yield _sse(first, api.named_events)
        try:
            async for item in stream:
                yield _sse(item, api.named_events)
        except PolicyError as e:
            err = api.error(502, f"the policy engine failed: {e}")
            yield _sse({"type": "error", **err} if api.named_events else err, api.named_events)

    @app.post("/s/{sid}/v1/chat/completions")
    async def chat_completions(sid: str, request: Request) -> Response:
        return await handle(request, sid, CHAT)

    @app.post("/s/{sid}/v1/responses")
    async def create_response(sid: str, request: Request) -> Response:
        return await handle(request, sid, RESPONSES)

    @app.post("/s/{sid}/v1/messages")
    async def messages(sid: str, request: Request) -> Response:
        return await handle(request, sid, MESSAGES)

    @app.post("/s/{sid}/v1/messages/count_tokens")
    async def count_tokens(sid: str, request: Request) -> Response:
        async def count(session: Session, raw: dict[str, Any]) -> Response:
            call = anthropic.read({**raw, "max_tokens": 1}, session)
            ids = gateway.tokenizer.encode_chat(call.messages, call.tools or None, add_generation_prompt=True)
            return JSONResponse({"input_tokens": len(ids)})
        return await handle(request, sid, MESSAGES, count)

    @app.get("/s/{sid}/v1/models")
    async def models(sid: str, request: Request) -> Response:
        anthropic_shape = "anthropic-version" in request.headers
        try:
            session_of(request, sid)
        except Unauthorized as e:
            return JSONResponse((anthropic.error if anthropic_shape else openai_error)(401, str(e)), status_code=401)
        if anthropic_shape:
            return JSONResponse({"data": [{"type": "model", "id": model_name, "display_name": model_name,
                                           "created_at": "1970-01-01T00:00:00Z"}],
                                 "has_more": False, "first_id": model_name, "last_id": model_name})
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                                         "owned_by": "agentenv"}]})

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def anything_else(path: str) -> Response:
        return JSONResponse(openai_error(401, "unknown session or wrong API key"), status_code=401)

    return app
