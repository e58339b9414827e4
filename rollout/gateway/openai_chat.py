"""OpenAI Chat Completions (``POST /v1/chat/completions``) on the gateway.

Read: ``messages`` (``developer`` is a system message; content as text or text parts; an assistant's ``tool_calls``
and ``reasoning_content``, or ``reasoning`` as some clients name it; ``tool`` results), ``tools`` (functions),
``tool_choice``, ``response_format``, ``max_completion_tokens`` / ``max_tokens``, ``stream`` and
``stream_options.include_usage``. ``n`` must be 1 (an episode is one conversation); sampling fields are the run's.

Written: a ``chat.completion`` with one choice, or its ``chat.completion.chunk`` stream as OpenAI sends it: the
role first, ``content`` deltas (``reasoning_content`` deltas for reasoning, as vLLM and DeepSeek send it), the tool
calls with their index, id, name and arguments, a last chunk with the ``finish_reason``, the usage chunk when
asked for, then ``data: [DONE]``. A malformed tool call is text with ``malformed_tool_calls: true`` on the choice.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from policy import chat
from rollout.gateway.messages import Answer, BadCall, Call, Delta, Message, text_of
from rollout.gateway.sessions import Session

FINISH = {"stop": "stop", "tool_calls": "tool_calls", "length": "length", "budget": "length"}


def _calls(calls: Any, session: Session) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise BadCall("an assistant message's tool_calls must be a list")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadCall("a tool call must be {'id', 'type': 'function', 'function': {'name', 'arguments'}}")
        args = fn.get("arguments", "{}")
        out.append({"id": session.k3_id(str(c.get("id") or "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return out


def read_messages(messages: Any, session: Session) -> list[Message]:
    """OpenAI-chat messages as the gateway's (see the module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise BadCall("messages must be a non-empty list")
    out: list[Message] = []
    for m in messages:
        if not isinstance(m, dict):
            raise BadCall("each message must be an object")
        role = m.get("role")
        if role in ("system", "developer", "user"):
            out.append({"role": "user" if role == "user" else "system", "content": text_of(m.get("content"))})
        elif role == "assistant":
            msg: Message = {"role": "assistant", "content": text_of(m.get("content"))}
            if m.get("tool_calls"):
                msg["tool_calls"] = _calls(m["tool_calls"], session)
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if isinstance(reasoning, str):
                msg["reasoning_content"] = reasoning
            out.append(msg)
        elif role == "tool":
            out.append({"role": "tool", "tool_call_id": session.k3_id(str(m.get("tool_call_id") or "")),
                        "content": text_of(m.get("content"))})
        else:
            raise BadCall(f"message role {role!r} is not supported (system, developer, user, assistant, tool)")
    return out


def read(body: dict[str, Any], session: Session) -> Call:
    if body.get("n", 1) != 1:
        raise BadCall("n must be 1: a harness episode is one conversation")
    try:
        tools, forced = chat.tool_choice_pieces(chat.validate_tools(body.get("tools")), body.get("tool_choice"))
    except ValueError as e:
        raise BadCall(str(e)) from None
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise BadCall("max_tokens must be a positive integer")
    fmt = body.get("response_format")
    return Call(read_messages(body.get("messages"), session), tools, forced,
                fmt if isinstance(fmt, dict) and fmt.get("type") != "text" else None,
                str(body.get("model") or ""), limit, bool(body.get("stream")))


def tool_calls(answer: Answer, session: Session) -> list[dict[str, Any]]:
    return [{"id": session.api_id("call", answer.node, i), "type": "function",
             "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
            for i, c in enumerate(answer.tool_calls)]


def usage(answer: Answer) -> dict[str, int]:
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens,
            "total_tokens": answer.prompt_tokens + answer.completion_tokens}


def body(call: Call, answer: Answer, session: Session) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": answer.content or (None if answer.tool_calls else "")}
    if answer.tool_calls:
        msg["tool_calls"] = tool_calls(answer, session)
    if answer.reasoning is not None:
        msg["reasoning_content"] = answer.reasoning
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": call.model, "choices": [{"index": 0, "message": msg, "finish_reason": FINISH[answer.finish],
                                               "logprobs": None, "malformed_tool_calls": answer.malformed}],
            "usage": usage(answer)}


async def events(call: Call, items: AsyncIterator[Delta | Answer], session: Session,
                 body_of: dict[str, Any]) -> AsyncIterator[dict[str, Any] | str]:
    """The chunk stream (each a JSON object; ``[DONE]`` as the string it is)."""
    head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": call.model}

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}]}

    yield chunk({"role": "assistant", "content": ""})
    async for item in items:
        if isinstance(item, Delta):
            yield chunk({"content": item.text} if item.kind == "text" else {"reasoning_content": item.text})
            continue
        if item.tool_calls:
            yield chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(tool_calls(item, session))]})
        yield chunk({}, FINISH[item.finish], malformed_tool_calls=item.malformed)
        if (body_of.get("stream_options") or {}).get("include_usage"):
            yield {**head, "choices": [], "usage": usage(item)}
    yield "[DONE]"
