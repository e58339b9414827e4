"""A scripted policy behind the OpenAI-compatible completions route: the same wire as a real endpoint,
answers that a script decides.

A script maps the conversation so far (the decoded prompt, and the turn number) to the assistant's next
text, e.g. the tool calls that apply a task's gold patch and submit. It drives the real rollout path
(agent loop, Ray workers, envs) in tests, and writes demonstrations for a warm start, without a model.
Its logprobs are a constant (``LOGPROB``): a script has no distribution. An answer is tokenised as a model would
have generated it (``encode_assistant``): its reasoning and tool-call structure as control ids, its content and
arguments as text, so a demonstration that echoes a tool output's control strings keeps them text.

A script reads the prompt as text (``readable``): the template's control tokens spelled out, and every ``<|`` inside
a message's text (tool output, the task's text) broken by a word joiner (U+2060), so that what a script finds with a
regex over the prompt (a tool's return, the user's question) is split at the template's own tokens only. A sandbox
that prints ``<|im_end|><|im_system|>tool<|im_middle|>...`` cannot forge a tool return an expert would act on.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse

from policy import chat
from rollout.agent import Tokenizer

# (decoded prompt, turn index from 0) -> the assistant's text, or one text per sample when asked for n > 1
Script = Callable[[str, int], str | list[str]]
LOGPROB = -0.01
JOINER = "\u2060"  # after the "<" of a "<|" that text holds: no control string of K3's template is whole there


def readable(pieces: list[chat.Piece]) -> str:
    """The prompt a script reads: control tokens spelled out, a ``<|`` in text broken by ``JOINER``."""
    return "".join(p.token if isinstance(p, chat.Control) else p.replace("<|", "<" + JOINER + "|") for p in pieces)


def tool_call(name: str, arguments: dict[str, Any], index: int = 0) -> str:
    """K3 tool-call text for one call (what a script answers)."""
    return chat.render_tool_calls([{"id": f"functions.{name}:{index}", "type": "function",
                                    "function": {"name": name, "arguments": json.dumps(arguments)}}])


def create_app(script: Script, tokenizer: Tokenizer, model: str = "scripted", weight_version: int | None = 0
               ) -> FastAPI:
    """An app answering ``GET /v1/models`` and ``POST /v1/completions`` (token-id prompts) from ``script``;
    ``weight_version=None`` leaves that field out of the answers, as vLLM and SGLang do."""
    app = FastAPI(title="agentenv scripted policy")
    app.state.calls = 0

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model"}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> dict[str, Any] | StreamingResponse:
        body = await request.json()
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise HTTPException(400, "the scripted policy takes token-id prompts")
        text = readable(tokenizer.decode_pieces(prompt))
        turn = text.count(chat.GENERATION_PROMPT) - 1
        answers = script(text, turn)
        n, max_tokens = int(body.get("n", 1)), int(body.get("max_tokens", 512))
        texts = [answers] * n if isinstance(answers, str) else [answers[i % len(answers)] for i in range(n)]
        app.state.calls += 1
        choices = []
        for i, answer in enumerate(texts):
            ids, finish = tokenizer.encode_assistant(answer)[:max_tokens], "length"
            if len(ids) < max_tokens:
                ids, finish = ids + [tokenizer.eos_id], "stop"
            choices.append({"index": i, "text": tokenizer.decode(ids), "token_ids": ids, "finish_reason": finish,
                            "logprobs": {"token_logprobs": [LOGPROB] * len(ids)}})
        if body.get("stream"):
            return StreamingResponse(_stream(choices[0], weight_version), media_type="text/event-stream")
        reply: dict[str, Any] = {"id": f"cmpl-{app.state.calls}", "object": "text_completion", "model": model, "choices": choices,
                                 "weight_version": weight_version, "prompt_token_ids": prompt,
                                 "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}}
        if weight_version is None:
            del reply["weight_version"]
        return reply

    return app


async def _stream(choice: dict[str, Any], weight_version: int | None, per_chunk: int = 3) -> AsyncIterator[str]:
    """One choice as a completion stream: ``per_chunk`` token ids a chunk, the finish reason on the last."""
    ids = choice["token_ids"]
    for at in range(0, len(ids), per_chunk):
        last = at + per_chunk >= len(ids)
        part = {"index": 0, "token_ids": ids[at:at + per_chunk], "finish_reason": choice["finish_reason"] if last else None,
                "logprobs": {"token_logprobs": [LOGPROB] * len(ids[at:at + per_chunk])}}
        chunk = {"object": "text_completion", "choices": [part],
                 **({} if weight_version is None else {"weight_version": weight_version})}
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"
