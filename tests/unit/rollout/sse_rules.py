"""Validators of each API's server-sent event sequence, written from the providers' API references (not from the
gateway's code): OpenAI Chat Completions chunks, Anthropic Messages streaming events, OpenAI Responses streaming
events. Each takes the raw SSE text, raises AssertionError naming the broken rule, and returns what the stream
assembles to, so a test can compare it with the non-streaming answer."""

from __future__ import annotations

import json
from typing import Any


def parse_sse(text: str) -> list[tuple[str | None, str]]:
    """(event name or None, data) per event; comments and blank lines skipped."""
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith(":") or not line:
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
        if data:
            out.append((name, "\n".join(data)))
    return out


def chat_chunks(text: str) -> dict[str, Any]:
    """OpenAI ``chat.completion.chunk`` stream: data-only events, ``[DONE]`` last; one id; the role first; tool call
    deltas keyed by index, the first of each with id, type and name; one finish_reason, on the last choice chunk;
    a usage chunk (empty choices) only after it."""
    events = parse_sse(text)
    assert events and events[-1] == (None, "[DONE]"), "the stream must end with data: [DONE]"
    assert all(name is None for name, _ in events), "chat chunks carry no event names"
    chunks = [json.loads(d) for _, d in events[:-1]]
    assert chunks, "no chunk before [DONE]"
    assert len({c["id"] for c in chunks}) == 1, "every chunk has the same id"
    assert all(c["object"] == "chat.completion.chunk" and isinstance(c["created"], int) for c in chunks)
    with_choices = [c for c in chunks if c["choices"]]
    usage = [i for i, c in enumerate(chunks) if not c["choices"]]
    assert with_choices[0]["choices"][0]["delta"].get("role") == "assistant", "the first delta carries the role"
    finishes = [i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    assert len(finishes) == 1, f"exactly one chunk has a finish_reason, got {len(finishes)}"
    assert chunks[finishes[0]] is with_choices[-1], "the finish_reason is on the last choice chunk"
    assert all(i > finishes[0] for i in usage), "the usage chunk comes after the finish"
    for i in usage:
        u = chunks[i]["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    content, reasoning, calls = "", "", {}
    for c in with_choices:
        ch = c["choices"][0]
        assert ch["index"] == 0
        d = ch["delta"]
        content += d.get("content") or ""
        reasoning += d.get("reasoning_content") or ""
        for t in d.get("tool_calls") or []:
            assert isinstance(t["index"], int), "a tool call delta has an index"
            if t["index"] not in calls:
                assert t.get("id") and t.get("type") == "function" and t["function"].get("name"), \
                    "the first delta of a tool call has its id, type and name"
                calls[t["index"]] = {"id": t["id"], "name": t["function"]["name"], "arguments": ""}
            calls[t["index"]]["arguments"] += t["function"].get("arguments") or ""
    finish = chunks[finishes[0]]["choices"][0]["finish_reason"]
    assert finish in ("stop", "length", "tool_calls", "content_filter", "function_call")
    assert (finish == "tool_calls") == bool(calls) or finish == "length", "tool calls end with finish tool_calls"
    return {"content": content, "reasoning": reasoning, "tool_calls": [calls[i] for i in sorted(calls)],
            "finish_reason": finish, "usage": chunks[usage[0]]["usage"] if usage else None}


BLOCK_DELTAS = {"text": {"text_delta"}, "thinking": {"thinking_delta", "signature_delta"},
                "tool_use": {"input_json_delta"}}


def anthropic_events(text: str) -> dict[str, Any]:
    """Anthropic Messages stream: every event named as its type; ``message_start`` first; content blocks one at a
    time, indexed from 0, each start → deltas of its kind → stop; ``message_delta`` with the stop reason, then
    ``message_stop`` last; ``ping`` anywhere; a tool's ``partial_json`` adds up to a JSON object."""
    events = [(n, json.loads(d)) for n, d in parse_sse(text)]
    assert all(n == e["type"] for n, e in events), "each event's name is its data's type"
    events = [(n, e) for n, e in events if n != "ping"]
    assert events[0][0] == "message_start", "message_start comes first"
    start = events[0][1]["message"]
    assert start["type"] == "message" and start["role"] == "assistant" and start["content"] == []
    assert start["stop_reason"] is None
    assert [n for n, _ in events[-2:]] == ["message_delta", "message_stop"], "message_delta then message_stop end it"
    blocks: list[dict[str, Any]] = []
    open_block: dict[str, Any] | None = None
    for name, e in events[1:-2]:
        if name == "content_block_start":
            assert open_block is None and e["index"] == len(blocks), "blocks open one at a time, indexed from 0"
            open_block = dict(e["content_block"])
            open_block["_json"] = ""
        elif name == "content_block_delta":
            assert open_block is not None and e["index"] == len(blocks)
            d = e["delta"]
            assert d["type"] in BLOCK_DELTAS[open_block["type"]], f"{d['type']} in a {open_block['type']} block"
            if d["type"] == "text_delta":
                open_block["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                open_block["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                open_block["signature"] = d["signature"]
            else:
                open_block["_json"] += d["partial_json"]
        elif name == "content_block_stop":
            assert open_block is not None and e["index"] == len(blocks)
            raw = open_block.pop("_json")
            if open_block["type"] == "tool_use":
                open_block["input"] = json.loads(raw or "{}")
                assert isinstance(open_block["input"], dict), "a tool's input is a JSON object"
            blocks.append(open_block)
            open_block = None
        else:
            raise AssertionError(f"unexpected event {name} between message_start and message_delta")
    assert open_block is None, "every block is stopped"
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn",
                                             "refusal")
    assert isinstance(delta["usage"]["output_tokens"], int)
    assert (delta["delta"]["stop_reason"] == "tool_use") == any(b["type"] == "tool_use" for b in blocks) or \
        delta["delta"]["stop_reason"] == "max_tokens"
    return {"content": blocks, "stop_reason": delta["delta"]["stop_reason"]}


def responses_events(text: str) -> dict[str, Any]:
    """OpenAI Responses stream: named events, ``sequence_number`` 0, 1, 2, …; ``response.created`` then
    ``response.in_progress``; each output item added (output_index from 0), its parts and deltas, its done events
    whose text is the deltas joined, ``output_item.done``; ``response.completed`` or ``response.incomplete`` last,
    with the output items done in order; no ``[DONE]``."""
    raw = parse_sse(text)
    assert all(d != "[DONE]" for _, d in raw), "the Responses stream has no [DONE]"
    events = [(n, json.loads(d)) for n, d in raw]
    assert all(n == e["type"] for n, e in events), "each event's name is its data's type"
    assert [e["sequence_number"] for _, e in events] == list(range(len(events))), "sequence numbers count from 0"
    assert [n for n, _ in events[:2]] == ["response.created", "response.in_progress"]
    rid = events[0][1]["response"]["id"]
    assert events[0][1]["response"]["status"] == "in_progress"
    last_name, last = events[-1]
    assert last_name in ("response.completed", "response.incomplete"), f"ends with {last_name}"
    assert last["response"]["id"] == rid and last["response"]["status"] == last_name.split(".")[1]
    items: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    text_so_far = ""
    for name, e in events[2:-1]:
        if name == "response.output_item.added":
            assert cur is None and e["output_index"] == len(items), "items open one at a time, indexed from 0"
            cur, text_so_far = e["item"], ""
            continue
        assert cur is not None and e.get("output_index") == len(items), f"{name} outside its item"
        if name != "response.output_item.done":
            assert e["item_id"] == cur["id"], f"{name} names its item"
        if name in ("response.output_text.delta", "response.reasoning_text.delta",
                    "response.function_call_arguments.delta"):
            text_so_far += e["delta"]
        elif name in ("response.output_text.done", "response.reasoning_text.done"):
            assert e["text"] == text_so_far, f"{name}'s text is its deltas joined"
        elif name == "response.function_call_arguments.done":
            assert e["arguments"] == text_so_far and isinstance(json.loads(e["arguments"]), dict)
        elif name == "response.output_item.done":
            assert e["item"]["id"] == cur["id"] and e["item"]["type"] == cur["type"]
            items.append(e["item"])
            cur = None
        elif name not in ("response.content_part.added", "response.content_part.done"):
            raise AssertionError(f"unexpected event {name}")
    assert cur is None, "every item is done"
    assert last["response"]["output"] == items, "the final response holds the items done, in order"
    return last["response"]
