"""OpenAI-compatible HTTP server for the policy (FastAPI): chat and text completions with token ids and
logprobs, streaming, weight updates, health and metrics. Every route except /health and /metrics needs
``Authorization: Bearer <token>``; bad input is answered with a 4xx and a reason."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from policy.chat import (
    ARG_BEGIN,
    CALL_BEGIN,
    SECTION_BEGIN,
    THINK_BEGIN,
    THINK_END,
    parse_assistant,
    render_chat,
    validate_tools,
)
from policy.engine import Engine, SamplingParams, Sequence


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: bool | int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]]
    tools: Any = None
    tool_choice: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[int]


class UpdateWeightsRequest(BaseModel):
    path: str
    mode: str = "drain"


def _bad(msg: str, code: int = 400) -> HTTPException:
    return HTTPException(code, detail=msg)


def create_app(engine: Engine, token: str, model_name: str = "k3-mini") -> FastAPI:
    """Build the app around a running ``engine``; ``token`` guards every route but /health and /metrics."""
    app = FastAPI(title="agentenv policy (K3)")
    tok = engine.tokenizer

    def auth(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, detail="missing or wrong bearer token")

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"error": {"message": exc.detail, "type": "invalid_request_error", "code": exc.status_code}},
                            status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        reason = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:])}: {e['msg']}" for e in exc.errors())
        return JSONResponse({"error": {"message": reason, "type": "invalid_request_error", "code": 400}}, status_code=400)

    def params_of(req: _Sampling, prompt_len: int) -> list[SamplingParams]:
        if req.model != model_name:
            raise _bad(f"unknown model {req.model!r}; this server serves {model_name!r}", 404)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = 256 if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise _bad("max_tokens must be at least 1")
        if prompt_len >= engine.max_context:
            raise _bad(f"the prompt has {prompt_len} tokens but the context is {engine.max_context}")
        if not 1 <= req.n <= 16:
            raise _bad("n must be between 1 and 16")
        if req.temperature < 0 or not 0 < req.top_p <= 1:
            raise _bad("temperature must be >= 0 and top_p in (0, 1]")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        return [SamplingParams(max_tokens, req.temperature, req.top_p,
                               None if req.seed is None else req.seed + i, stop) for i in range(req.n)]

    def submit(prompt_ids: list[int], params: list[SamplingParams]) -> tuple[list[Sequence], asyncio.Queue]:
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()  # type: ignore[var-annotated]

        def listener(s: Sequence) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (s, len(s.output_ids), s.finish_reason))

        try:
            return [engine.submit(prompt_ids, p, listener) for p in params], queue
        except ValueError as e:
            raise _bad(str(e)) from e

    async def wait_all(seqs: list[Sequence], queue: asyncio.Queue) -> None:
        pending = {s.seq_id for s in seqs}
        while pending:
            s, _, finish = await queue.get()
            if finish is not None:
                pending.discard(s.seq_id)

    def logprob_items(s: Sequence, start: int = 0, end: int | None = None) -> list[dict[str, Any]]:
        items = []
        for t, lp in zip(s.output_ids[start:end], s.logprobs[start:end], strict=True):
            text = tok.decode([t])
            items.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
        return items

    def base(kind: str) -> dict[str, Any]:
        return {"id": f"{kind}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": model_name}

    def usage(prompt_ids: list[int], seqs: list[Sequence]) -> dict[str, int]:
        c = sum(len(s.output_ids) for s in seqs)
        return {"prompt_tokens": len(prompt_ids), "completion_tokens": c, "total_tokens": len(prompt_ids) + c}

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
            raise _bad(f"could not load weights: {e}") from e
        return {"ok": True, "weight_version": version}

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)], response_model=None)
    async def chat(req: ChatRequest) -> Any:
        try:
            tools = validate_tools(req.tools)
            forced = ""
            if req.tool_choice == "none":
                tools = []
            elif isinstance(req.tool_choice, dict):
                name = (req.tool_choice.get("function") or {}).get("name")
                if name not in {t["function"]["name"] for t in tools}:
                    raise ValueError(f"tool_choice names a function that is not in tools: {name!r}")
                forced = f"{SECTION_BEGIN}{CALL_BEGIN}functions.{name}:0{ARG_BEGIN}"
            elif req.tool_choice == "required":  # the model must open a tool call; it picks the function
                if not tools:
                    raise ValueError("tool_choice 'required' needs tools")
                forced = f"{SECTION_BEGIN}{CALL_BEGIN}functions."
            elif req.tool_choice not in (None, "auto"):
                raise ValueError("tool_choice must be 'none', 'auto', 'required' or a named function")
            prompt_ids = tok.encode(render_chat(req.messages, tools) + forced)
        except (ValueError, AttributeError, TypeError, KeyError) as e:
            raise _bad(f"bad request: {e}") from e
        params = params_of(req, len(prompt_ids))
        seqs, queue = submit(prompt_ids, params)
        head = {**base("chatcmpl"), "weight_version": engine.weight_version}

        def choice(s: Sequence, i: int) -> dict[str, Any]:
            msg = parse_assistant(forced + s.text)
            finish = "tool_calls" if msg.tool_calls and s.finish_reason == "stop" else s.finish_reason
            return {"index": i, "message": msg.to_openai(), "finish_reason": finish, "token_ids": s.output_ids,
                    "logprobs": {"content": logprob_items(s)} if req.logprobs else None,
                    "malformed_tool_calls": msg.malformed, "abort_reason": s.abort_reason}

        if not req.stream:
            await wait_all(seqs, queue)
            return {**head, "object": "chat.completion", "weight_version": seqs[0].weight_version,
                    "choices": [choice(s, i) for i, s in enumerate(seqs)], "prompt_token_ids": prompt_ids,
                    "usage": usage(prompt_ids, seqs)}

        async def events() -> AsyncIterator[str]:
            index = {s.seq_id: i for i, s in enumerate(seqs)}
            sent_tokens = dict.fromkeys(index, 0)
            sent_text = dict.fromkeys(index, "")
            chunk = {**head, "object": "chat.completion.chunk"}
            for i in index.values():  # the first chunk of each choice carries the prompt's token ids
                yield _sse({**chunk, "prompt_token_ids": prompt_ids, "choices": [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
            pending = set(index)
            while pending:
                s, n, finish = await queue.get()
                new_ids, lps = s.output_ids[sent_tokens[s.seq_id]:n], logprob_items(s, sent_tokens[s.seq_id], n)
                sent_tokens[s.seq_id] = n
                visible = "" if forced else _streamable(s.text)
                delta: dict[str, Any] = {}
                if finish is not None:
                    pending.discard(s.seq_id)
                    final = choice(s, index[s.seq_id])
                    content = final["message"]["content"] or ""
                    if content.startswith(sent_text[s.seq_id]):
                        delta["content"] = content[len(sent_text[s.seq_id]):]
                    if final["message"].get("reasoning_content") is not None:
                        delta["reasoning_content"] = final["message"]["reasoning_content"]
                    if "tool_calls" in final["message"]:
                        delta["tool_calls"] = [{**c, "index": j} for j, c in enumerate(final["message"]["tool_calls"])]
                    out = {"index": index[s.seq_id], "delta": delta, "finish_reason": final["finish_reason"],
                           "token_ids": new_ids, "malformed_tool_calls": final["malformed_tool_calls"],
                           "abort_reason": s.abort_reason}
                elif visible.startswith(sent_text[s.seq_id]):
                    delta["content"] = visible[len(sent_text[s.seq_id]):]
                    sent_text[s.seq_id] = visible
                    out = {"index": index[s.seq_id], "delta": delta, "finish_reason": None, "token_ids": new_ids}
                else:  # hold text back while a tag or tool call may be forming
                    out = {"index": index[s.seq_id], "delta": {}, "finish_reason": None, "token_ids": new_ids}
                if req.logprobs:
                    out["logprobs"] = {"content": lps}
                yield _sse({**chunk, "weight_version": s.weight_version, "choices": [out]})
            if (req.stream_options or {}).get("include_usage"):
                yield _sse({**chunk, "choices": [], "usage": usage(prompt_ids, seqs)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions", dependencies=[Depends(auth)], response_model=None)
    async def completions(req: CompletionRequest) -> Any:
        prompt_ids = tok.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        params = params_of(req, len(prompt_ids))
        seqs, queue = submit(prompt_ids, params)
        head = {**base("cmpl"), "object": "text_completion", "weight_version": engine.weight_version}

        def lp_block(s: Sequence, start: int = 0, end: int | None = None) -> dict[str, Any] | None:
            if not req.logprobs:
                return None
            items = logprob_items(s, start, end)
            return {"tokens": [x["token"] for x in items], "token_logprobs": [x["logprob"] for x in items],
                    "top_logprobs": None, "text_offset": []}

        if not req.stream:
            await wait_all(seqs, queue)
            return {**head, "weight_version": seqs[0].weight_version, "prompt_token_ids": prompt_ids,
                    "choices": [{"index": i, "text": s.text, "finish_reason": s.finish_reason, "token_ids": s.output_ids,
                                 "logprobs": lp_block(s), "abort_reason": s.abort_reason} for i, s in enumerate(seqs)],
                    "usage": usage(prompt_ids, seqs)}

        async def events() -> AsyncIterator[str]:
            index = {s.seq_id: i for i, s in enumerate(seqs)}
            sent_tokens, sent_text = dict.fromkeys(index, 0), dict.fromkeys(index, "")
            pending = set(index)
            while pending:
                s, n, finish = await queue.get()
                delta = ""
                if s.text.startswith(sent_text[s.seq_id]):
                    delta, sent_text[s.seq_id] = s.text[len(sent_text[s.seq_id]):], s.text
                if finish is not None:
                    pending.discard(s.seq_id)
                first = {"prompt_token_ids": prompt_ids} if sent_tokens[s.seq_id] == 0 else {}
                yield _sse({**head, **first, "choices": [{
                    "index": index[s.seq_id], "text": delta, "finish_reason": finish,
                    "token_ids": s.output_ids[sent_tokens[s.seq_id]:n], "logprobs": lp_block(s, sent_tokens[s.seq_id], n)}]})
                sent_tokens[s.seq_id] = n
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _streamable(text: str) -> str:
    """The part of generated text that is surely plain content: no open reasoning, nothing from a tool-call section."""
    body = text.split(SECTION_BEGIN, 1)[0]
    if body.startswith(THINK_BEGIN) or THINK_BEGIN.startswith(body):
        if THINK_END not in body:
            return ""
        body = body.split(THINK_END, 1)[1]
    return body


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
