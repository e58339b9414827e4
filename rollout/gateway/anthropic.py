"""Anthropic Messages (``POST /v1/messages``, ``/v1/messages/count_tokens``) on the gateway.

Read: ``system`` (text or text blocks), ``messages`` whose content is text or blocks: ``text``; ``tool_use`` and
``tool_result`` (its content text or text blocks; ``is_error`` results are rendered as their text); ``thinking``
(the reasoning of an assistant turn; ``redacted_thinking`` is refused, there is nothing to render). ``tools``
(custom tools: ``name``, ``description``, ``input_schema``; Anthropic's server tools are refused),
``tool_choice`` (``auto``, ``any``, ``tool``, ``none``), ``max_tokens`` (required), ``stream``. Images and
documents are refused: the policy reads text. Sampling fields and ``thinking`` settings are the run's.

Written: a ``message`` whose content is a ``thinking`` block when the model reasoned, a ``text`` block, and a
``tool_use`` block per call (``stop_reason`` ``end_turn``, ``tool_use`` or ``max_tokens``); or its stream as
Anthropic sends it: ``message_start``, each block's ``content_block_start`` / ``_delta`` / ``_stop`` (thinking and
text deltas as generated, a tool call's input as one ``input_json_delta``), ``message_delta`` with the stop reason
and usage, ``message_stop``. A malformed tool call is text, with ``malformed_tool_calls: true`` on the message.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from policy import chat
from rollout.gateway.messages import Answer, BadCall, Call, Delta, Message, function_tools, text_of
from rollout.gateway.sessions import Session

SIGNATURE = "agentenv"   # a thinking block's signature: the gateway checks none, the SDKs want one
STOP = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens", "budget": "max_tokens"}


def error(status: int, message: str) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            504: "timeout_error"}.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise BadCall("a message's content must be text or a list of blocks")
    return content


def _assistant(blocks: list[dict[str, Any]], session: Session) -> Message:
    text, reasoning, calls = [], [], []
    for b in blocks:
        kind = b.get("type")
        if kind == "text":
            text.append(str(b.get("text", "")))
        elif kind == "thinking":
            reasoning.append(str(b.get("thinking", "")))
        elif kind == "tool_use":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise BadCall("a tool_use block needs a name and an input object")
            calls.append({"id": session.k3_id(str(b.get("id") or "")), "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
        else:
            raise BadCall(f"an assistant block of type {kind!r} is not supported (text, thinking, tool_use)")
    msg: Message = {"role": "assistant", "content": "".join(text)}
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    return msg


def _user(blocks: list[dict[str, Any]], session: Session) -> list[Message]:
    out: list[Message] = []
    text: list[str] = []
    for b in blocks:
        kind = b.get("type")
        if kind == "text":
            text.append(str(b.get("text", "")))
        elif kind == "tool_result":
            content = b.get("content", "")
            out.append({"role": "tool", "tool_call_id": session.k3_id(str(b.get("tool_use_id") or "")),
                        "content": text_of(content if isinstance(content, str | list) else str(content))})
        else:
            raise BadCall(f"a user block of type {kind!r} is not supported by this policy (text, tool_result)")
    if text:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _tool(t: dict[str, Any]) -> dict[str, Any] | None:
    if t.get("type", "custom") != "custom" or not isinstance(t.get("name"), str):
        return None
    return {"name": t["name"], "description": str(t.get("description", "")),
            "parameters": t.get("input_schema") or {"type": "object"}}


def _choice(choice: Any) -> Any:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise BadCall("tool_choice must be {'type': 'auto' | 'any' | 'tool' | 'none'}")


def read(body: dict[str, Any], session: Session) -> Call:
    limit = body.get("max_tokens")
    if not isinstance(limit, int) or limit < 1:
        raise BadCall("max_tokens is required and must be a positive integer")
    system = body.get("system")
    messages: list[Message] = [{"role": "system", "content": text_of(system)}] if system else []
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadCall("messages must be a non-empty list")
    for m in raw:
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            messages += _user(_blocks(m.get("content")), session)
        elif role == "assistant":
            messages.append(_assistant(_blocks(m.get("content")), session))
        else:
            raise BadCall("a message's role must be 'user' or 'assistant'")
    try:
        tools, forced = chat.tool_choice_pieces(chat.validate_tools(function_tools(
            body.get("tools"), _tool, "only custom tools ({'name', 'description', 'input_schema'}) are supported")),
                                                _choice(body.get("tool_choice")))
    except ValueError as e:
        raise BadCall(str(e)) from None
    return Call(messages, tools, forced, None, str(body.get("model") or ""), limit, bool(body.get("stream")))


def _tool_block(answer: Answer, i: int, session: Session) -> dict[str, Any]:
    c = answer.tool_calls[i]
    return {"type": "tool_use", "id": session.api_id("toolu", answer.node, i), "name": c["function"]["name"],
            "input": json.loads(c["function"]["arguments"])}


def _usage(answer: Answer) -> dict[str, int]:
    return {"input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens}


def body(call: Call, answer: Answer, session: Session) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if answer.reasoning is not None:
        content.append({"type": "thinking", "thinking": answer.reasoning, "signature": SIGNATURE})
    if answer.content or not answer.tool_calls:
        content.append({"type": "text", "text": answer.content})
    content += [_tool_block(answer, i, session) for i in range(len(answer.tool_calls))]
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": call.model,
            "content": content, "stop_reason": STOP[answer.finish], "stop_sequence": None, "usage": _usage(answer),
            "malformed_tool_calls": answer.malformed}


async def events(call: Call, items: AsyncIterator[Delta | Answer], session: Session,
                 raw: dict[str, Any]) -> AsyncIterator[dict[str, Any] | str]:
    yield {"type": "message_start", "message": {
        "id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": call.model,
        "content": [], "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}}
    index, open_kind = -1, ""

    def close() -> list[dict[str, Any]]:
        out = []
        if open_kind == "thinking":
            out.append({"type": "content_block_delta", "index": index,
                        "delta": {"type": "signature_delta", "signature": SIGNATURE}})
        if open_kind:
            out.append({"type": "content_block_stop", "index": index})
        return out

    async for item in items:
        if isinstance(item, Delta):
            kind = "thinking" if item.kind == "reasoning" else "text"
            if kind != open_kind:
                for e in close():
                    yield e
                index, open_kind = index + 1, kind
                empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                    {"type": "text", "text": ""}
                yield {"type": "content_block_start", "index": index, "content_block": empty}
            delta = {"type": "thinking_delta", "thinking": item.text} if kind == "thinking" else \
                {"type": "text_delta", "text": item.text}
            yield {"type": "content_block_delta", "index": index, "delta": delta}
            continue
        for e in close():
            yield e
        if index < 0 and not item.tool_calls:   # an empty answer still has its text block
            index += 1
            yield {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}
            yield {"type": "content_block_stop", "index": index}
        for i in range(len(item.tool_calls)):
            block = _tool_block(item, i, session)
            index += 1
            yield {"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}}
            yield {"type": "content_block_delta", "index": index,
                   "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}}
            yield {"type": "content_block_stop", "index": index}
        yield {"type": "message_delta", "delta": {"stop_reason": STOP[item.finish], "stop_sequence": None},
               "usage": _usage(item), "malformed_tool_calls": item.malformed}
        yield {"type": "message_stop"}
