"""Constrained decoding (llguidance): an untrained model held to a JSON schema writes schema-valid JSON, through
the engine and through the server's ``response_format`` and forced tool calls; bad schemas are a clear 400."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from policy.chat import parse_assistant
from policy.engine import SamplingParams
from policy.grammar import Constraint, json_schema_grammar
from policy.jsonschema import schema_errors

pytest.importorskip("llguidance")

AUTH = {"Authorization": "Bearer t"}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "count", "ok", "kind"], "properties": {
    "name": {"type": "string", "maxLength": 8}, "count": {"type": "integer", "minimum": -5, "maximum": 500},
    "ok": {"type": "boolean"}, "kind": {"enum": ["bug", "feature", "chore"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "required": ["city"], "additionalProperties": False,
             "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}}}}},
         {"type": "function", "function": {"name": "stop_now", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]


def test_an_untrained_model_held_to_a_schema_writes_valid_json(engine_pair):
    eng = engine_pair[0]
    grammar = json_schema_grammar(SCHEMA)
    prompt = eng.tokenizer.encode_chat([{"role": "user", "content": "report"}])
    seqs = [eng.submit(prompt, SamplingParams(max_tokens=96, temperature=1.0, seed=s, grammar=grammar))
            for s in range(6)]
    for s in seqs:
        s.done.wait(60)
        assert s.finish_reason == "stop" and s.output_ids[-1] == eng.tokenizer.eos_id, s.text
        assert schema_errors(json.loads(s.text), SCHEMA) == [], s.text
        assert all(lp <= 0 for lp in s.logprobs)
    assert len({s.text for s in seqs}) > 1


def test_bad_schemas_are_refused(engine_pair):
    with pytest.raises(ValueError, match="invalid grammar or schema"):
        Constraint(engine_pair[0].tokenizer, json_schema_grammar({"type": "nonsense"}))
    with pytest.raises(ValueError):
        json_schema_grammar([1, 2])  # type: ignore[arg-type]


def test_response_format_and_forced_tool_calls_over_http(server_app, tok):
    client = TestClient(server_app[0])
    msgs = [{"role": "user", "content": "file a ticket"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": SCHEMA}}
    r = client.post("/v1/chat/completions", headers=AUTH, json={
        "model": "k3-mini", "messages": msgs, "response_format": fmt, "n": 3, "temperature": 1.0, "seed": 5,
        "max_tokens": 96}).json()
    for c in r["choices"]:
        assert c["finish_reason"] == "stop" and schema_errors(json.loads(c["message"]["content"]), SCHEMA) == []
    r = client.post("/v1/completions", headers=AUTH, json={
        "model": "k3-mini", "prompt": "{", "response_format": {"type": "json_object"}, "max_tokens": 64,
        "temperature": 0}).json()
    assert r["choices"][0]["finish_reason"] in ("stop", "length")
    if r["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(r["choices"][0]["text"]), dict)

    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        r = client.post("/v1/chat/completions", headers=AUTH, json={
            "model": "k3-mini", "messages": msgs, "tools": TOOLS, "tool_choice": choice, "n": 3, "temperature": 1.0,
            "seed": 1, "max_tokens": 64}).json()
        for c in r["choices"]:
            assert c["finish_reason"] == "tool_calls" and not c["malformed_tool_calls"], c
            call = c["message"]["tool_calls"][0]["function"]
            params = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["name"])
            assert schema_errors(json.loads(call["arguments"]), params) == []
            # the generated tokens are K3's tool-call format: the shared parser reads the same call
            head = tok.decode(r["prompt_token_ids"]).rsplit("<|im_middle|>", 1)[1]
            assert parse_assistant(head + tok.decode(c["token_ids"][:-1])).tool_calls[0]["function"] == call

    for body in ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
                 {"response_format": {"type": "yaml"}}):
        r = client.post("/v1/chat/completions", headers=AUTH, json={"model": "k3-mini", "messages": msgs, **body})
        assert r.status_code == 400 and r.json()["error"]["message"], r.json()
