"""OpenAI Responses (``POST /v1/responses``) on the gateway.

Read: ``instructions`` (a system message), ``input`` as text or items: messages (``system`` / ``developer`` /
``user`` / ``assistant``, content as text or ``input_text`` / ``output_text`` parts), ``function_call`` and
``function_call_output``, ``reasoning`` (its ``content`` text, else its summary: the reasoning of the assistant turn
that follows). ``previous_response_id`` continues a response this session answered (responses are kept per
session; ``store: false`` keeps none). ``tools`` (``function`` tools; built-in tools are refused), ``tool_choice``,
``text.format`` (``json_schema`` / ``json_object``), ``max_output_tokens``, ``stream``.

Written: a ``response`` whose ``output`` is a ``reasoning`` item when the model reasoned, a ``message`` with one
``output_text`` part, and a ``function_call`` item per call; ``status`` ``incomplete`` (``max_output_tokens``) when
generation stopped on its limit or a budget. Streamed as OpenAI sends it, every event with its ``sequence_number``:
``response.created``, ``response.in_progress``, each item's ``output_item.added`` / deltas / ``done`` events, and
``response.completed`` (or ``response.incomplete``). A malformed tool call is text, with
``malformed_tool_calls: true`` on the response.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from policy import chat
from rollout.gateway.messages import Answer, BadCall, Call, Delta, Message, function_tools, text_of
from rollout.gateway.sessions import Session


def _flush(out: list[Message], pending: Message | None) -> None:
    if pending is not None:
        out.append(pending)


def read_input(items: Any, session: Session) -> list[Message]:
    """Input items as the gateway's messages: reasoning and function calls join the assistant turn they belong to."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise BadCall("input must be text or a list of items")
    out: list[Message] = []
    pending: Message | None = None   # the assistant turn being read

    def turn() -> Message:
        nonlocal pending
        if pending is None:
            pending = {"role": "assistant", "content": ""}
        return pending

    for item in items:
        if not isinstance(item, dict):
            raise BadCall("each input item must be an object")
        kind, role = item.get("type", "message"), item.get("role")
        if kind == "reasoning":
            if pending is not None and (pending["content"] or pending.get("tool_calls")):
                _flush(out, pending)
                pending = None
            parts = item.get("content") or item.get("summary") or []
            turn()["reasoning_content"] = "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict))
        elif kind == "function_call":
            turn().setdefault("tool_calls", []).append({
                "id": session.k3_id(str(item.get("call_id") or "")), "type": "function",
                "function": {"name": str(item.get("name") or ""), "arguments": str(item.get("arguments") or "{}")}})
        elif kind == "message" and role == "assistant":
            if pending is not None and (pending["content"] or pending.get("tool_calls")):
                _flush(out, pending)
                pending = None
            turn()["content"] = text_of(item.get("content"))
        elif kind == "message" and role in ("system", "developer", "user"):
            _flush(out, pending)
            pending = None
            out.append({"role": "user" if role == "user" else "system", "content": text_of(item.get("content"))})
        elif kind == "function_call_output":
            _flush(out, pending)
            pending = None
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": session.k3_id(str(item.get("call_id") or "")),
                        "content": text_of(output if isinstance(output, str | list) else json.dumps(output))})
        else:
            raise BadCall(f"input items of type {kind!r} (role {role!r}) are not supported")
    _flush(out, pending)
    return out


def _tool(t: dict[str, Any]) -> dict[str, Any] | None:
    if t.get("type") != "function":
        return None
    return {k: t[k] for k in ("name", "description", "parameters") if k in t}


def _choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(text: Any) -> dict[str, Any] | None:
    fmt = (text or {}).get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    raise BadCall("text.format.type must be 'text', 'json_schema' or 'json_object'")


def read(body: dict[str, Any], session: Session) -> Call:
    messages: list[Message] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if previous not in session.stored:
            raise BadCall(f"previous_response_id {previous!r} is not a response of this session")
        messages += session.stored[previous]
    if body.get("instructions"):
        messages = [m for m in messages if m["role"] != "system" or m is not messages[0]]
        messages.insert(0, {"role": "system", "content": text_of(body["instructions"])})
    messages += read_input(body.get("input"), session)
    if not messages:
        raise BadCall("input is empty")
    limit = body.get("max_output_tokens")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise BadCall("max_output_tokens must be a positive integer")
    try:
        tools, forced = chat.tool_choice_pieces(chat.validate_tools(function_tools(
            body.get("tools"), _tool, "only function tools are supported (built-in tools run on OpenAI's side)")),
                                                _choice(body.get("tool_choice")))
    except ValueError as e:
        raise BadCall(str(e)) from None
    return Call(messages, tools, forced, _format(body.get("text")), str(body.get("model") or ""), limit,
                bool(body.get("stream")))


def _items(answer: Answer, session: Session) -> Iterator[dict[str, Any]]:
    if answer.reasoning is not None:
        yield {"type": "reasoning", "id": f"rs_{answer.node}", "summary": [],
               "content": [{"type": "reasoning_text", "text": answer.reasoning}]}
    if answer.content or not answer.tool_calls:
        yield {"type": "message", "id": f"msg_{answer.node}", "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": answer.content, "annotations": [], "logprobs": []}]}
    for i, c in enumerate(answer.tool_calls):
        yield {"type": "function_call", "id": f"fc_{answer.node}_{i}", "call_id": session.api_id("call", answer.node, i),
               "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}


def _response(rid: str, call: Call, status: str, output: list[dict[str, Any]], answer: Answer | None) -> dict[str, Any]:
    incomplete = status == "incomplete"
    usage = None if answer is None else {
        "input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens,
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
        "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status, "model": call.model,
            "output": output, "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": None, "metadata": {}, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "temperature": None, "top_p": None, "usage": usage,
            "malformed_tool_calls": bool(answer and answer.malformed)}


def _finished(call: Call, answer: Answer, session: Session, raw: dict[str, Any], rid: str) -> dict[str, Any]:
    if raw.get("store", True):
        session.stored[rid] = [*call.messages, answer.message()]
    status = "incomplete" if answer.finish in ("length", "budget") else "completed"
    return _response(rid, call, status, list(_items(answer, session)), answer)


def body(call: Call, answer: Answer, session: Session) -> dict[str, Any]:
    return _finished(call, answer, session, {}, f"resp_{uuid.uuid4().hex[:24]}")


async def events(call: Call, items: AsyncIterator[Delta | Answer], session: Session,
                 raw: dict[str, Any]) -> AsyncIterator[dict[str, Any] | str]:
    seq = 0

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        nonlocal seq
        seq += 1
        return {"type": kind, "sequence_number": seq - 1, **fields}

    started = _response(f"resp_{uuid.uuid4().hex[:24]}", call, "in_progress", [], None)
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    index, open_kind, item_id, text = -1, "", "", ""
    done: list[dict[str, Any]] = []

    def close() -> Iterator[dict[str, Any]]:
        if open_kind == "reasoning":
            item = {"type": "reasoning", "id": item_id, "summary": [],
                    "content": [{"type": "reasoning_text", "text": text}]}
            yield event("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0, text=text)
        elif open_kind == "text":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item = {"type": "message", "id": item_id, "status": "completed", "role": "assistant", "content": [part]}
            yield event("response.output_text.done", item_id=item_id, output_index=index, content_index=0, text=text,
                        logprobs=[])
            yield event("response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part)
        else:
            return
        done.append(item)
        yield event("response.output_item.done", output_index=index, item=item)

    async for it in items:
        if isinstance(it, Delta):
            if it.kind != open_kind:
                for e in close():
                    yield e
                index, open_kind, text = index + 1, it.kind, ""
                item_id = f"{'rs' if it.kind == 'reasoning' else 'msg'}_{uuid.uuid4().hex[:12]}"
                if it.kind == "reasoning":
                    yield event("response.output_item.added", output_index=index, item={
                        "type": "reasoning", "id": item_id, "summary": [], "content": []})
                else:
                    yield event("response.output_item.added", output_index=index, item={
                        "type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []})
                    yield event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            text += it.text
            kind = "response.reasoning_text.delta" if it.kind == "reasoning" else "response.output_text.delta"
            extra: dict[str, Any] = {} if it.kind == "reasoning" else {"logprobs": []}
            yield event(kind, item_id=item_id, output_index=index, content_index=0, delta=it.text, **extra)
            continue
        for e in close():
            yield e
        final = _finished(call, it, session, raw, started["id"])
        for item in final["output"][len(done):]:
            index += 1
            for e in _whole_item(event, item, index):
                yield e
        final["output"] = done + final["output"][len(done):]
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        yield event(kind, response=final)


def _whole_item(event: Any, item: dict[str, Any], index: int) -> Iterator[dict[str, Any]]:
    """The events of an output item that was not streamed as generated: a tool call, an empty message."""
    if item["type"] == "function_call":
        yield event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                           "status": "in_progress"})
        yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                    delta=item["arguments"])
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                    name=item["name"], arguments=item["arguments"])
    else:
        part = item["content"][0]
        yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                           "content": []})
        yield event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                    part={**part, "text": ""})
        yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                    text=part["text"], logprobs=[])
        yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
    yield event("response.output_item.done", output_index=index, item=item)
