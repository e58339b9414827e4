"""The policy server's answers against a scripted engine (no model): a streamed answer adds up to the same
message, tool calls, finish reason and tokens as the whole one, for chat and text completions."""

from __future__ import annotations

import itertools
import json
import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient

from policy.engine import SamplingParams, Sequence
from policy.server import create_app
from policy.tokenizer import load_tokenizer

TOKEN = "t"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


class ScriptedEngine:
    """Answers every sequence with the next scripted text, token by token, from a thread."""

    def __init__(self, script: list[str]) -> None:
        self.tokenizer = load_tokenizer()
        self.max_context, self.weight_version = 256, 3
        self.script, self._ids = itertools.cycle(script), itertools.count()
        self.threads: list[threading.Thread] = []

    def submit(self, prompt_ids: list[int], params: SamplingParams, listener: Any = None) -> Sequence:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        seq = Sequence(next(self._ids), list(prompt_ids), params, listener, weight_version=self.weight_version)
        ids = self.tokenizer.encode_assistant(next(self.script))[: params.max_tokens]
        t = threading.Thread(target=self._run, args=(seq, ids, len(ids) < params.max_tokens))
        t.start()
        self.threads.append(t)
        return seq

    def _run(self, seq: Sequence, ids: list[int], stop: bool) -> None:
        assert seq.listener is not None
        for i, t in enumerate(ids):
            seq.output_ids.append(t)
            seq.logprobs.append(-0.5)
            seq.text = self.tokenizer.decode(seq.output_ids)
            if i == len(ids) - 1:
                seq.finish_reason = "stop" if stop else "length"
            seq.listener(seq)

    def metrics(self) -> dict[str, Any]:
        return {}


def _client(script: list[str]) -> TestClient:
    return TestClient(create_app(ScriptedEngine(script), TOKEN))  # type: ignore[arg-type]


def _events(client: TestClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", path, json={**body, "stream": True}, headers=AUTH) as r:
        assert r.status_code == 200
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


ENDS = "<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
CALL = ('<|open|>tools<|sep|><|open|>call tool="get_weather" index="0"<|sep|><|open|>json type="object"<|sep|>'
        '{"city": "Paris"}' + ENDS)


@pytest.mark.parametrize(("text", "tool_choice"), [
    ("Plain answer, no tools.", None),
    ("<think>reason first</think>The answer.", None),
    ("Let me look." + CALL, None),
    ("<think>r</think>" + CALL, "auto"),
    ('Broken<|open|>tools<|sep|><|open|>call tool="get_weather"<|sep|><|open|>json<|sep|>{oops', None),
    ('{"city": "Rome"}' + ENDS, {"type": "function", "function": {"name": "get_weather"}}),
    ('get_weather" index="0"<|sep|><|open|>json type="object"<|sep|>{"city": "Oslo"}' + ENDS, "required"),
])
def test_a_streamed_chat_answer_adds_up_to_the_whole_answer(text, tool_choice):
    client = _client([text])
    body = {"model": "k3-mini", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            "tool_choice": tool_choice, "max_tokens": 100, "logprobs": True, "n": 2,
            "stream_options": {"include_usage": True}}
    whole = client.post("/v1/chat/completions", json=body, headers=AUTH).json()
    events = _events(client, "/v1/chat/completions", body)
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    for i, want in enumerate(whole["choices"]):
        chunks = [c for e in events for c in e["choices"] if c["index"] == i]
        assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
        assert [e["prompt_token_ids"] for e in events if "prompt_token_ids" in e][i] == whole["prompt_token_ids"]
        last = chunks[-1]
        assert [c["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert last["finish_reason"] == want["finish_reason"]
        assert last["malformed_tool_calls"] == want["malformed_tool_calls"]
        assert sum((c.get("token_ids", []) for c in chunks), []) == want["token_ids"]
        assert sum((c["logprobs"]["content"] for c in chunks[1:]), []) == want["logprobs"]["content"]
        assert "".join(c["delta"].get("content") or "" for c in chunks) == (want["message"]["content"] or "")
        assert last["delta"].get("reasoning_content") == want["message"].get("reasoning_content")
        assert [{k: v for k, v in c.items() if k != "index"} for c in last["delta"].get("tool_calls", [])] == \
            want["message"].get("tool_calls", [])
    assert all(e["weight_version"] == 3 for e in events) and whole["weight_version"] == 3


def test_chat_tool_calls_and_malformed_come_from_parse_assistant():
    client = _client(["Sure." + CALL.replace(' index="0"<|sep|>', " <|sep|>\n")])
    r = client.post("/v1/chat/completions", json={"model": "k3-mini", "messages": [{"role": "user", "content": "x"}],
                                                  "tools": TOOLS}, headers=AUTH).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and not choice["malformed_tool_calls"]
    assert choice["message"] == {"role": "assistant", "content": "Sure.", "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    client = _client(["x" + CALL + "trailing text"])
    choice = client.post("/v1/chat/completions", json={"model": "k3-mini", "messages": [{"role": "user", "content": "x"}]},
                         headers=AUTH).json()["choices"][0]
    assert choice["malformed_tool_calls"] and choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == "x" + CALL + "trailing text"


@pytest.mark.parametrize("logprobs", [None, 1])
def test_a_streamed_text_completion_adds_up_to_the_whole_one(logprobs):
    client = _client(["def main():\n    return 42\n", "short"])
    body = {"model": "k3-mini", "prompt": "x", "max_tokens": 6, "n": 2, "logprobs": logprobs, "seed": 1}
    whole = client.post("/v1/completions", json=body, headers=AUTH).json()
    events = _events(client, "/v1/completions", body)
    by_index: dict[int, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for e in events:
        by_index.setdefault(e["choices"][0]["index"], []).append((e, e["choices"][0]))
    for i, want in enumerate(whole["choices"]):
        pairs = by_index[i]
        assert pairs[0][0]["prompt_token_ids"] == whole["prompt_token_ids"]
        assert all("prompt_token_ids" not in e for e, _ in pairs[1:])
        assert "".join(c["text"] for _, c in pairs) == want["text"]
        assert sum((c["token_ids"] for _, c in pairs), []) == want["token_ids"]
        assert pairs[-1][1]["finish_reason"] == want["finish_reason"]
        if logprobs:
            assert sum((c["logprobs"]["token_logprobs"] for _, c in pairs), []) == want["logprobs"]["token_logprobs"]
        else:
            assert all(c["logprobs"] is None for _, c in pairs) and want["logprobs"] is None
    assert {c["finish_reason"] for c in whole["choices"]} == {"length", "stop"}


def test_bad_requests_are_4xx_with_a_reason():
    client = _client(["x"])
    msgs = [{"role": "user", "content": "x"}]
    for body, code in [({"model": "other", "messages": msgs}, 404),
                       ({"model": "k3-mini", "messages": msgs, "n": 17}, 400),
                       ({"model": "k3-mini", "messages": msgs, "tool_choice": "required"}, 400),
                       ({"model": "k3-mini", "messages": msgs, "tools": TOOLS,
                         "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400),
                       ({"model": "k3-mini", "messages": [{"role": "robot"}]}, 400),
                       ({"model": "k3-mini"}, 400)]:
        r = client.post("/v1/chat/completions", json=body, headers=AUTH)
        assert r.status_code == code and r.json()["error"]["message"], body
    r = client.post("/v1/completions", json={"model": "k3-mini", "prompt": []}, headers=AUTH)
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={"model": "k3-mini", "prompt": "x"}).status_code == 401
