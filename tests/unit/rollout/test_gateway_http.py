"""The gateway's HTTP face in process (its app over the scripted policy app, no sockets): a session is reached only
with its capability and its key, whatever the route; bad requests are 400s in each API's error format and change
no tape; what the gateway refuses (images, server tools, n > 1) says so; the SSE validators themselves fail on
broken streams."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from policy.tokenizer import load_tokenizer
from rollout import scripted
from rollout.gateway.app import create_app
from rollout.gateway.turns import Gateway
from rollout.gateway.upstream import Upstream

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sse_rules  # noqa: E402
from rollout_fakes import TOK  # noqa: E402


def answer(text: str, turn: int) -> str:
    return "<think>hm</think>fine" if "## Return of" in text else "ok" + scripted.tool_call("f", {"x": 1})


@pytest.fixture()
def gw():
    engine = scripted.create_app(answer, TOK)
    gateway = Gateway(Upstream("http://engine", transport=httpx.ASGITransport(app=engine)), load_tokenizer())
    with TestClient(create_app(gateway)) as client:
        yield gateway, client


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_session_is_reached_only_with_its_own_capability_and_key(gw):
    gateway, client = gw
    a, b = gateway.open(), gateway.open()
    ok = client.post(f"/s/{a.id}/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {a.key}"})
    assert ok.status_code == 200
    for path, headers in [
        (f"/s/{a.id}/v1/chat/completions", {}),                                           # no key
        (f"/s/{a.id}/v1/chat/completions", {"Authorization": f"Bearer {b.key}"}),         # another session's key
        (f"/s/{b.id}/v1/chat/completions", {"Authorization": f"Bearer {a.key}"}),
        (f"/s/{a.id}/v1/chat/completions", {"Authorization": f"Bearer {a.key}x"}),
        (f"/s/{'x' * len(a.id)}/v1/chat/completions", {"Authorization": f"Bearer {a.key}"}),
        (f"/s/{a.id}/v1/messages", {"x-api-key": b.key}),
        (f"/s/{a.id}/v1/models", {"Authorization": f"Bearer {b.key}"}),
        ("/v1/chat/completions", {"Authorization": f"Bearer {a.key}"}),                   # no capability in the URL
        (f"/s/{a.id}/v1/embeddings", {"Authorization": f"Bearer {a.key}"}),               # a route it does not serve
    ]:
        r = client.post(path, json=CHAT, headers=headers) if "models" not in path else client.get(path, headers=headers)
        assert r.status_code == 401, (path, r.status_code, r.text)
    assert len(a.tape.nodes) == 1 and b.tape.nodes == []
    closed = gateway.close(a)
    assert client.post(f"/s/{a.id}/v1/chat/completions", json=CHAT,
                       headers={"Authorization": f"Bearer {a.key}"}).status_code == 401
    assert closed is a


@pytest.mark.parametrize(("path", "body", "why"), [
    ("/v1/chat/completions", {"model": "m", "messages": []}, "messages must be a non-empty list"),
    ("/v1/chat/completions", {**CHAT, "n": 2}, "n must be 1"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "text only"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not in tools"),
    ("/v1/responses", {"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "only function tools"),
    ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens is required"),
    ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                      "tools": [{"type": "bash_20250124", "name": "bash"}]}, "only custom tools"),
])
def test_bad_requests_are_400s_in_the_apis_format_and_leave_the_tape_alone(gw, path, body, why):
    gateway, client = gw
    s = gateway.open()
    r = client.post(f"/s/{s.id}{path}", json=body, headers={"Authorization": f"Bearer {s.key}", "x-api-key": s.key})
    assert r.status_code == 400 and why in r.text
    err = r.json()
    assert (err["type"] == "error" and err["error"]["type"] == "invalid_request_error") if "messages" in path else \
        err["error"]["type"] == "invalid_request_error"
    assert s.tape.nodes == []


def test_any_model_name_gets_the_policy_and_is_recorded(gw):
    gateway, client = gw
    s = gateway.open()
    for name in ("gpt-5", "claude-opus-4-1", "anything/at-all"):
        r = client.post(f"/s/{s.id}/v1/chat/completions", json={**CHAT, "model": name},
                        headers={"Authorization": f"Bearer {s.key}"})
        assert r.json()["model"] == name
    assert s.asked_models == {"gpt-5", "claude-opus-4-1", "anything/at-all"}
    listed = client.get(f"/s/{s.id}/v1/models", headers={"Authorization": f"Bearer {s.key}"}).json()
    assert [m["id"] for m in listed["data"]] == ["k3-mini"]
    shaped = client.get(f"/s/{s.id}/v1/models", headers={"x-api-key": s.key, "anthropic-version": "2023-06-01"})
    assert shaped.json()["data"][0]["type"] == "model"


def _stream(client, s, path: str, body: dict) -> str:
    r = client.post(f"/s/{s.id}{path}", json={**body, "stream": True},
                    headers={"Authorization": f"Bearer {s.key}", "x-api-key": s.key})
    assert r.status_code == 200
    return r.text


def test_the_validators_fail_on_broken_streams(gw):
    """Each validator passes the gateway's stream and fails on it once a rule is broken (it can fail)."""
    gateway, client = gw
    chat = _stream(client, gateway.open(), "/v1/chat/completions", CHAT)
    sse_rules.chat_chunks(chat)
    for broken in (chat.replace("data: [DONE]\n\n", ""), chat.replace('"role": "assistant"', '"role": "user"'),
                   chat.replace('"finish_reason": "tool_calls"', '"finish_reason": null')):
        with pytest.raises(AssertionError):
            sse_rules.chat_chunks(broken)
    msgs = _stream(client, gateway.open(), "/v1/messages", {**CHAT, "max_tokens": 50})
    sse_rules.anthropic_events(msgs)
    events = msgs.strip().split("\n\n")
    for broken in ("\n\n".join(events[:-1]), "\n\n".join([events[0], *events[2:]]),
                   msgs.replace('"index": 1', '"index": 2')):
        with pytest.raises(AssertionError):
            sse_rules.anthropic_events(broken)
    resp = _stream(client, gateway.open(), "/v1/responses", {"model": "m", "input": "hi"})
    sse_rules.responses_events(resp)
    events = resp.strip().split("\n\n")
    for broken in ("\n\n".join(events[:-1]), resp + "data: [DONE]\n\n", resp.replace('"sequence_number": 3', '"sequence_number": 9')):
        with pytest.raises((AssertionError, KeyError)):
            sse_rules.responses_events(broken)


def test_admin_routes_open_and_close_sessions_and_take_no_session_key():
    engine = scripted.create_app(answer, TOK)
    gateway = Gateway(Upstream("http://engine", transport=httpx.ASGITransport(app=engine)), load_tokenizer())
    admin = {"Authorization": "Bearer admin-token"}
    with TestClient(create_app(gateway, admin_token="admin-token")) as client:
        opened = client.post("/admin/sessions", json={"budget": {"turns": 3}, "sampling": {"max_tokens": 32},
                                                      "labels": {"task": "t1"}}, headers=admin).json()
        assert opened["openai_base_url"].endswith(f"/s/{opened['id']}/v1")
        s = gateway.sessions.get(opened["id"], opened["key"])
        assert s.config.budget.turns == 3 and s.config.sampling.max_tokens == 32 and s.labels == {"task": "t1"}
        assert client.post("/admin/sessions", json={"budget": {"turn": 3}}, headers=admin).status_code == 422
        for headers in ({}, {"Authorization": f"Bearer {opened['key']}"}, {"Authorization": "Bearer admin-tokenx"}):
            assert client.post("/admin/sessions", json={}, headers=headers).status_code == 401
            assert client.delete(f"/admin/sessions/{opened['id']}", headers=headers).status_code == 401
        r = client.post(f"/s/{opened['id']}/v1/chat/completions", json=CHAT,
                        headers={"Authorization": f"Bearer {opened['key']}"})
        assert r.status_code == 200
        assert client.get(f"/admin/sessions/{opened['id']}", headers=admin).json()["calls"] == 1
        closed = client.delete(f"/admin/sessions/{opened['id']}", headers=admin).json()
        assert closed["summary"]["calls"] == 1 and len(closed["records"]) == 1
        assert closed["records"][0]["token_ids"] == s.tape.nodes[0].full_ids(load_tokenizer().eos_id)
        assert client.get(f"/admin/sessions/{opened['id']}", headers=admin).status_code == 404
        assert client.post("/admin/hold", headers=admin).json() == {"held": True} and gateway.holding
        assert client.post("/admin/release", headers=admin).json() == {"held": False} and not gateway.holding
